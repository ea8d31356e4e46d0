"""vLLM server processes: ``VLLMServer`` (an ``SGLangServer``'s process handling: own process group, log file, health
polling, stop, restart, attach; only the command line and the environment differ) and the flags a run's config asks
for. vllm itself is imported by nothing here: its server runs from ``rollout.vllm.python`` (the CPU server's own venv).

    server = VLLMServer(hf_dir, python=".venv-vllm/bin/python", device="cpu", kv_cache_gib=0.25)
    server.start(); server.wait_healthy(600); ...; server.stop()     # stops only the process group it started

Flags every server gets (vLLM 0.32.0; file:line under site-packages/vllm/):

* ``VLLM_SERVER_DEV_MODE=1``: the routes a weight sync needs, /collective_rpc, /pause, /resume, /abort_requests,
  /update_weight_version (entrypoints/launchers/api_server/routers.py:40-47, envs.py:1487). vLLM's own ``--api-key``
  does not guard them (serve/middleware/authenticate.py:11): ``--middleware ...guard.RequireKey`` does.
* ``--worker-extension-cls ...worker_ext.DapoWorkerExtension``: the checksums a sync is verified with
  (worker_ext.py says why not /weight_checker).
* ``--logprobs-mode processed_logprobs``: logprobs of the temperature-scaled distribution, the engine convention
  (engines/base.py); vLLM's default ``raw_logprobs`` is before the temperature (v1/sample/sampler.py:81-105). It is
  also after top-p/top-k, so the config refuses those (options.validate).
* ``--generation-config vllm``: no sampling defaults from the checkpoint's generation_config.json, whose
  ``stop_token_ids`` would join every request (config/model.py:354-360).
* ``--skip-tokenizer-init`` for the project's char tokenizer (token ids in, token ids out), as for SGLang.
* On a CPU: ``--enforce-eager`` (no torch.compile: start-up in ~40 s instead of minutes, platforms/cpu.py:356-380)
  and the KV cache in bytes (``rollout.vllm.kv_cache_gib``; vLLM's default takes 92% of the host's memory,
  cache.py:102, cpu_worker.py:73-95).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from megatron_dapo.engines.sglang.server import DTYPE_NAMES, SGLangServer, rollout_dtype, server_pythonpath

GiB = 1 << 30
WORKER_EXTENSION = "megatron_dapo.engines.vllm.worker_ext.DapoWorkerExtension"
GUARD = "megatron_dapo.engines.vllm.guard.RequireKey"
PLATFORM_ARGS = {"cuda": (), "cpu": ("--enforce-eager",)}
PLATFORM_ENV = {"cuda": (), "cpu": ()}


def package_root() -> str:
    """The directory holding ``megatron_dapo``: on the servers' PYTHONPATH (the worker extension and the guard are
    imported by vLLM from the server's own venv)."""
    return str(Path(__file__).resolve().parents[3])


def server_env(device: str) -> dict[str, str]:
    return {"VLLM_SERVER_DEV_MODE": "1", **dict(PLATFORM_ENV[device])}


class VLLMServer(SGLangServer):
    """One vLLM server (``python -m vllm.entrypoints.openai.api_server``): a subprocess this object started, or an
    attached URL."""

    ARGS_FILE_KEYS = ("api-key",)  # vLLM's --config takes its flags' names: --api-key (guard.py reads it too)

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        python: str = "",
        kv_cache_gib: float = 0.0,
        pythonpath: Sequence[str | Path] = (),
        env: dict[str, str] | None = None,
        **kwargs,
    ):
        super().__init__(model_path, env=env, **kwargs)
        self.python = str(Path(python).absolute()) if python else sys.executable
        self.kv_cache_gib = kv_cache_gib
        self.launcher = [self.python, "-m", "vllm.entrypoints.openai.api_server"]
        self.env = {**server_env(self.platform.name), **(env or {})}
        self.env["PYTHONPATH"] = server_pythonpath([package_root(), *pythonpath])
        if self.log_path is not None and self.log_path.name.startswith("sglang_"):
            self.log_path = self.log_path.with_name("vllm_" + self.log_path.name.removeprefix("sglang_"))
            self.args_file = self.log_path.with_name(self.log_path.stem + ".args.yaml")

    def __repr__(self) -> str:
        return f"VLLMServer({self.url}{', attached' if self.attached else ''})"

    def argv(self) -> list[str]:
        """The command line: the launcher behind the redacting wrapper; the key is in ``--config``, not here."""
        args = [sys.executable, "-m", "megatron_dapo.engines.sglang.auth", *self.launcher]
        args += common_args(str(self.model_path), self.host, self.port, self.tp_size, self.mem_fraction)
        if self.dtype:
            args += ["--dtype", self.dtype]
        if self.kv_cache_gib:
            args += ["--kv-cache-memory-bytes", str(int(self.kv_cache_gib * GiB))]
        if self.memory_saver:
            args.append("--enable-sleep-mode")
        return args + list(PLATFORM_ARGS[self.platform.name]) + self.extra_args + ["--config", str(self.args_file)]


def common_args(model: str, host: str, port: int, tp: int, mem_fraction: float) -> list[str]:
    return [
        "--model", model, "--host", host, "--port", str(port), "--tensor-parallel-size", str(tp),
        "--gpu-memory-utilization", str(mem_fraction), "--generation-config", "vllm",
        "--logprobs-mode", "processed_logprobs", "--max-logprobs", "1",
        "--worker-extension-cls", WORKER_EXTENSION, "--middleware", GUARD,
    ]  # fmt: skip


def installed(cfg) -> bool:
    """Whether the servers' interpreter (``rollout.vllm.python``, else this one) finds vllm; it is not imported."""
    import importlib.util
    import subprocess

    python = cfg.rollout.vllm.python
    if not python:
        return importlib.util.find_spec("vllm") is not None
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return Path(python).is_file() and subprocess.run([python, "-c", probe], timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def tp_from_config(cfg) -> int:
    return cfg.rollout.vllm.tp


def device_from_config(cfg) -> str:
    return cfg.rollout.vllm.device


def server_dtype(cfg) -> str:
    """As SGLang's (``rollout.dtype``; auto = bf16 on GPUs and on CPUs with bf16 units, else fp32)."""
    return rollout_dtype(cfg, cfg.rollout.vllm.device)


def server_args(cfg) -> list[str]:
    """The flags a run's config asks for (beyond ``common_args`` and the platform's); the Slurm launcher uses the
    same list."""
    from megatron_dapo.data.tokenizer import is_char_tokenizer
    from megatron_dapo.models.arch import load_arch, routes_wanted

    r = cfg.rollout
    arch = load_arch(cfg.model.arch)
    args = ["--seed", str(cfg.train.seed), "--max-model-len", str(cfg.max_seq_len)]
    if is_char_tokenizer(cfg.model.tokenizer or cfg.model.hf_init):
        args.append("--skip-tokenizer-init")
    elif cfg.model.tokenizer:
        args += ["--tokenizer", cfg.model.tokenizer]
    if routes_wanted(r.routing_replay, arch):  # per response [tokens, layers, top-k] (config/vllm.py:1135-1177)
        args.append("--enable-return-routed-experts")
    if r.weight_sync == "distributed":  # vLLM's NCCL weight transfer (nccl_sync.py; config/weight_transfer.py:12)
        args += ["--weight-transfer-config", '{"backend": "nccl"}']
    return args + list(r.vllm.args)


def servers_from_config(cfg, model_path, log_dir=None, server_urls=None) -> list[VLLMServer]:
    """Servers at ``server_urls`` (default ``rollout.server_urls``), attached; or one local server with the rollout
    section's settings, not started yet."""
    r, v = cfg.rollout, cfg.rollout.vllm
    urls = list(r.server_urls if server_urls is None else server_urls)
    if urls:
        logs = json.loads(os.environ.get("DAPO_SERVER_LOGS") or "{}")
        return [VLLMServer(url=u, tp_size=v.tp, device=v.device, log_path=logs.get(u)) for u in urls]
    return [
        VLLMServer(
            model_path,
            python=v.python,
            kv_cache_gib=v.kv_cache_gib,
            tp_size=v.tp,
            mem_fraction=r.mem_fraction,
            memory_saver=r.colocate and v.device == "cuda",  # sleep mode: CUDA only (config/model.py:655-657)
            dtype=DTYPE_NAMES[server_dtype(cfg)],
            extra_args=server_args(cfg),
            env=dict(kv.split("=", 1) for kv in v.env),
            log_path=Path(log_dir) / "vllm_server.log" if log_dir else None,
            device=v.device,
        )
    ]
