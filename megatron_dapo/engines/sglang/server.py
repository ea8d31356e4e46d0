"""SGLang server processes and HTTP: ``SGLangServer`` (start, health, stop, restart, or attach to a URL), ``http_call``,
and ``PLATFORMS``, what differs between SGLang on GPUs and on a CPU, as values.

    server = SGLangServer(hf_dir, port=30000, tp_size=8, mem_fraction=0.6, memory_saver=True)          # GPU
    server = SGLangServer(hf_dir, device="cpu", pythonpath=[stand_ins], mem_fraction=0.05)             # CPU
    server.start(); server.wait_healthy(600); ...; server.stop()      # stops only the process group it started

Servers listen on ``host`` (127.0.0.1 by default) and require the job's API key (``sglang_auth.py``): it reaches them
in a mode-0600 ``--config`` file next to the log (removed when the server stops), never on the command line, and the
server's output is copied to the log with the key redacted. ``http_call`` sends it as ``Authorization: Bearer``.

Servers are started with ``SGLANG_RETURN_ORIGINAL_LOGPROB=0`` so ``output_token_logprobs`` are the log-softmax of
the temperature-scaled logits, the convention of ``engine.py`` (sglang 0.5.23 srt/layers/sampler.py:275), and, with
``--enable-memory-saver`` on a GPU, ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1`` so that sleeping frees the CUDA graphs too
(``server_env``). sglang itself is imported by nothing here.
"""

from __future__ import annotations

import atexit
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.engines.sglang.auth import API_KEY_ENV, api_key, write_args_file
from megatron_dapo.types import RolloutError

log = logging.getLogger(__name__)

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with bf16 matmul units
HEALTH_TIMEOUT_S = 30.0  # GET /health runs a 1-token generation: seconds on a busy server


@dataclass(frozen=True)
class Platform:
    """Where SGLang runs, as values: the only place the device matters."""

    name: str
    server_args: tuple[str, ...]  # appended to every `sglang.launch_server` command
    env: tuple[tuple[str, str], ...]  # set for the server processes
    tensor_device: str  # the tensor transport hands over tensors here (cuda: CUDA IPC handles; cpu: shared memory)
    group_backend: str  # torch.distributed backend of the distributed transport's group
    sharing_strategy: str | None = None  # torch.multiprocessing sharing strategy the tensor transport needs
    # CUDA IPC handles name their device by UUID, as the server expects (sglang/srt/utils/patch_torch.py; the patch
    # handles CUDA tensors only: it breaks the pickling of CPU tensors)
    patch_ipc_reductions: bool = False
    memory_saver_env: tuple[tuple[str, str], ...] = ()  # also set for servers with --enable-memory-saver (colocated)
    memory_saver_args: tuple[str, ...] = ()  # also passed to servers with --enable-memory-saver


PLATFORMS = {
    "cuda": Platform(
        "cuda",
        (),
        (),
        tensor_device="cuda",
        group_backend="nccl",
        patch_ipc_reductions=True,
        # --enable-memory-saver alone leaves the CUDA graphs' memory held while the server sleeps: their capture joins
        # the memory saver (tag "cuda_graph") only when this is set (sglang 0.5.23 srt/environ.py:1645; read in
        # srt/model_executor/runner_backend/full_cuda_graph_backend.py:123, breakable_cuda_graph_backend.py:86,
        # cuda_graph_dedup_mixin.py:310, srt/distributed/parallel_state.py:1190). slime and verl set it too.
        memory_saver_env=(("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "1"),),
        # ...and then the prefill CUDA graphs must be off: on CUDA their default backend is the breakable one
        # (srt/model_executor/cuda_graph_config.py:119-122), whose constructor raises NotImplementedError under the
        # memory saver with that variable set (runner_backend/breakable_cuda_graph_backend.py:84-94), and SGLang's
        # compatibility rules do not turn it off for that (srt/arg_groups/cuda_graph_hook.py:170-230)
        memory_saver_args=("--disable-prefill-cuda-graph",),
    ),
    # The real SGLang 0.5.23 on a CPU (tests, demo_cpu_sglang). The server process also needs two import-only stand-ins
    # on its PYTHONPATH (rollout.sglang.pythonpath; see tests/sglang_cpu_support).
    "cpu": Platform(
        "cpu",
        (
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",  # the only attention backend SGLang runs on a CPU without AMX
            "--disable-cuda-graph",
            "--disable-overlap-schedule",
            "--sleep-on-idle",  # without it the idle scheduler spins one core at 100%
        ),
        (
            # without it `--device cpu` fails importing vllm (sglang/srt/layers/rotary_embedding)
            ("SGLANG_USE_CPU_ENGINE", "1"),
            # a stopped server (SIGTERM to its process group) sees its scheduler die and first sleeps 5 s "to let GPU
            # activity settle" before a py-spy dump and a CUDA coredump (sglang 0.5.23 srt/environ.py:401-402, read in
            # srt/managers/tokenizer_manager.py:3395-3485); a CPU has neither GPU activity nor coredumps
            ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0"),
            ("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0"),
        ),
        tensor_device="cpu",
        group_backend="gloo",
        # CPU tensors reach the server as shared-memory FILES: with torch's default "file_descriptor" strategy the
        # server must fetch the fds over a socket authenticated with this process tree's key, which it lacks; its
        # scheduler dies with AuthenticationError in rebuild_storage_fd (torch/multiprocessing/reductions.py).
        sharing_strategy="file_system",
    ),
}


class ServerUnavailable(RolloutError):
    """No answer (connection refused/reset, timeout): the server may be dead."""


class ServerRequestError(RolloutError):
    """The server answered with an HTTP error status."""


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never route local servers via a proxy


def http_call(
    url: str,
    path: str,
    body: dict | None = None,
    timeout: float = 60.0,
    method: str | None = None,
    key: str | None = None,
):
    """One JSON request carrying the job's API key (``key``: another one; "" none); returns the parsed JSON answer (or
    text, or None when empty)."""
    data = json.dumps(body).encode() if body is not None else None
    method = method or ("POST" if data is not None else "GET")
    key = api_key() if key is None else key
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method, headers=headers)
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:1000].decode(errors="replace")
        raise ServerRequestError(f"{method} {url}{path}: HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, ConnectionError, http.client.HTTPException, TimeoutError, OSError) as e:
        raise ServerUnavailable(f"{method} {url}{path}: {e}") from e
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


# ----------------------------------------------------------------------------------------------------------------------
# Server lifecycle


class SGLangServer:
    """One SGLang server: a subprocess this object started, or an attached URL (never stopped by us)."""

    ARGS_FILE_KEYS = ("api-key", "admin-api-key")  # the key's names in its --config file (auth.write_args_file)

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        tp_size: int = 1,
        mem_fraction: float = 0.6,
        memory_saver: bool = False,
        dtype: str | None = None,
        extra_args: Sequence[str] = (),
        launcher: Sequence[str] | None = None,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
        url: str | None = None,
        device: str = "cuda",
        pythonpath: Sequence[str | Path] = (),
    ):
        if url is None and model_path is None:
            raise ValueError("SGLangServer: give model_path (to start a server) or url (to attach to one)")
        if device not in PLATFORMS:
            raise ValueError(f"SGLangServer: device = {device!r}: expected one of {sorted(PLATFORMS)}")
        self.model_path = str(model_path) if model_path is not None else None
        self.host, self.tp_size, self.mem_fraction, self.memory_saver = host, tp_size, mem_fraction, memory_saver
        self.platform = PLATFORMS[device]
        self.dtype = DTYPE_NAMES.get(dtype, dtype) if dtype else None
        self.extra_args = list(extra_args)
        _refuse_data_parallel(self.extra_args)
        self.launcher = list(launcher) if launcher else [sys.executable, "-m", "sglang.launch_server"]
        self.env = {**server_env(self.platform.name, memory_saver), **(env or {})}
        if pythonpath:
            self.env["PYTHONPATH"] = server_pythonpath(pythonpath)
        self.attached = url is not None
        if port is None and not self.attached:
            from megatron_dapo.actor.dist import free_port  # lazily: this module's HTTP side needs no torch

            port = free_port(host)
        self.port = port
        self._url = url.rstrip("/") if url else f"http://{host}:{self.port}"
        default_log = None if self.attached else Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang_{self.port}.log"
        self.log_path = Path(log_path) if log_path else default_log  # attached: the launcher's log, if it said
        self.args_file = (  # the key: mode 0600, while the server runs
            self.log_path.with_name(self.log_path.stem + ".args.yaml") if self.log_path else Path(os.devnull)
        )
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @classmethod
    def attach(cls, url: str, tp_size: int = 1, device: str = "cuda", log_path: str | None = None) -> SGLangServer:
        return cls(url=url, tp_size=tp_size, device=device, log_path=log_path)

    @property
    def url(self) -> str:
        return self._url

    @property
    def node(self) -> str:
        """The host it runs on: this one for a started server, the URL's host for an attached one."""
        return urllib.parse.urlsplit(self._url).hostname if self.attached else socket.gethostname()

    def __repr__(self) -> str:
        return f"SGLangServer({self.url}{', attached' if self.attached else ''})"

    def argv(self) -> list[str]:
        """The command line: the launcher behind the redacting wrapper; the key is in ``--config``, not here."""
        args = [sys.executable, "-m", "megatron_dapo.engines.sglang.auth", *self.launcher]
        args += ["--model-path", str(self.model_path), "--host", self.host, "--port", str(self.port)]
        args += ["--tp-size", str(self.tp_size), "--mem-fraction-static", str(self.mem_fraction)]
        if self.dtype:
            args += ["--dtype", self.dtype]
        if self.memory_saver:
            args += ["--enable-memory-saver", *self.platform.memory_saver_args]
        return args + list(self.platform.server_args) + self.extra_args + ["--config", str(self.args_file)]

    def start(self) -> None:
        if self.attached:
            raise RolloutError(f"{self}: attached to an existing server; it cannot be started from here")
        if self.proc is not None and self.proc.poll() is None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        write_args_file(self.args_file, api_key(), keys=self.ARGS_FILE_KEYS)
        # the server reads its key from the file; a trainer's torch.distributed rendezvous is not the server's
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV and k not in TORCH_LAUNCH_VARS}
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n==== start {self.starts + 1}: {' '.join(self.argv())}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(
                self.argv(),
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**env, **self.env},
                start_new_session=True,  # own process group: stop() signals it and nothing else
            )
        self.starts += 1
        _STARTED.add(self)
        log.info("started %s (pid %d), log %s", self, self.proc.pid, self.log_path)

    def healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            return False
        try:
            http_call(self.url, "/health", timeout=timeout)
            return True
        except RolloutError:
            return False

    def wait_healthy(self, timeout: float) -> None:
        """Poll /health until it answers 200; raise with the log tail on timeout or when the process exits."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RolloutError(
                    f"{self} exited with code {self.proc.returncode} before becoming healthy; "
                    f"log {self.log_path}, last lines:\n{self.log_tail()}"
                )
            if self.healthy(timeout=min(HEALTH_TIMEOUT_S, max(0.5, deadline - time.monotonic()))):
                return
            if time.monotonic() >= deadline:
                raise RolloutError(
                    f"{self} not healthy after {timeout:.0f} s (GET /health); log {self.log_path}, "
                    f"last lines:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def stop(self, timeout: float = 30.0) -> None:
        """Terminate the process group this object started (SIGTERM, then SIGKILL) and wait until all of it is gone
        (also when its leader died alone: the port is free for a restart); attached servers are left alone."""
        proc, self.proc = self.proc, None
        _STARTED.discard(self)
        if proc is None:
            return
        self.args_file.unlink(missing_ok=True)
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)  # pgid == pid (start_new_session)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                proc.poll()  # reap the leader
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.1)
        proc.poll()

    def restart(self, timeout: float) -> None:
        self.stop()
        self.start()
        self.wait_healthy(timeout)

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None:
            return "(attached: no log here)"
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


# What torchrun / torch.distributed set for a trainer rank. A server started from a rank must not inherit them: SGLang
# 0.5.23 keeps an inherited MASTER_ADDR / MASTER_PORT for its own process group on a CPU ("setdefault so an explicit
# user-provided MASTER_ADDR/MASTER_PORT wins", sglang/srt/distributed/bootstrap.py _set_shm_master_env), then waits
# forever at "Init parallel begin" on the trainer's rendezvous port.
TORCH_LAUNCH_VARS = frozenset(
    {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
     "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
     "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
)  # fmt: skip


def server_env(device: str, memory_saver: bool) -> dict[str, str]:
    """The variables every server gets (before ``rollout.sglang.env``): T=1 logprobs (the engine's convention), the
    platform's, and with ``--enable-memory-saver`` the platform's memory-saver ones; the Slurm launcher uses the same."""
    platform = PLATFORMS[device]
    saver = platform.memory_saver_env if memory_saver else ()
    return {"SGLANG_RETURN_ORIGINAL_LOGPROB": "0", **dict(platform.env), **dict(saver)}


def server_pythonpath(paths: Sequence[str | Path]) -> str:
    """A server's PYTHONPATH (``rollout.sglang.pythonpath``): ``paths`` made absolute, ahead of the inherited one; the
    same for servers this process starts and those the Slurm launcher starts."""
    parts = [str(Path(p).resolve()) for p in paths] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    return os.pathsep.join(parts)


def cpu_has_bf16_units(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Without them torch computes bf16 linears by
    converting to fp32 and back: 5.1x slower than fp32 for a [64x576]x[576x1536] linear on an AVX2-only AMD EPYC
    (docs/benchmarks.md), faster than fp32 only where the units exist."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: assume no bf16 units
            return False
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    return any(f in flags for f in BF16_CPU_FLAGS)


def tp_from_config(cfg) -> int:
    return cfg.rollout.sglang.tp


def device_from_config(cfg) -> str:
    return cfg.rollout.sglang.device


def server_dtype(cfg) -> str:
    """The servers' weight dtype (fp32/bf16/fp16): ``rollout_dtype`` on SGLang's device."""
    return rollout_dtype(cfg, cfg.rollout.sglang.device)


def rollout_dtype(cfg, device: str) -> str:
    """A server engine's weight dtype on ``device``: rollout.dtype, None = model.dtype, auto = bf16 on GPUs and on CPUs
    with bf16 units, else fp32. Decided where the servers are started or their commands written (dapo launch on a CPU
    cluster assumes its nodes are alike)."""
    dtype = cfg.rollout.dtype or cfg.model.dtype
    if dtype != "auto":
        return dtype
    return "bf16" if device == "cuda" or cpu_has_bf16_units() else "fp32"


def server_args(cfg) -> list[str]:
    """The `sglang.launch_server` flags a run's config asks for (the platform's own come from ``PLATFORMS``); the Slurm
    launcher uses the same list."""
    r = cfg.rollout
    args = ["--random-seed", str(cfg.train.seed)]
    if r.sglang.deterministic:  # sampling_seed is ignored without it (GPU attention backends only)
        args.append("--enable-deterministic-inference")
    from megatron_dapo.data.tokenizer import is_char_tokenizer

    if is_char_tokenizer(cfg.model.tokenizer or cfg.model.hf_init):
        args.append("--skip-tokenizer-init")  # the project's char tokenizer is no HF tokenizer: ids in, ids out
    elif cfg.model.tokenizer:
        args += ["--tokenizer-path", cfg.model.tokenizer]
    from megatron_dapo.config.typed_yaml import ConfigError
    from megatron_dapo.engines.sglang.limits import cannot_serve
    from megatron_dapo.models.arch import load_arch, routes_wanted

    arch = load_arch(cfg.model.arch)
    if why := cannot_serve(arch):
        raise ConfigError(f"model.arch = {cfg.model.arch!r} with rollout.engine = sglang: {why}")
    if routes_wanted(r.routing_replay, arch):  # each response's routed experts: the actor replays or compares them
        args.append("--enable-return-routed-experts")
    return args + lora_server_args(cfg, arch) + list(r.sglang.args)


def lora_server_args(cfg, arch) -> list[str]:
    """SGLang's LoRA flags when the run syncs adapters only (``engines.registry.lora_adapter_sync``): the target modules in HF
    names (as the adapters are exported, ``bridge/peft.py``), room for 3 adapters at once (a sync loads the new version
    before it unloads the old one, which waits for the requests still using it), and on a CPU the ``torch_native``
    backend (the others need Triton)."""
    from megatron_dapo.bridge.peft import peft_config
    from megatron_dapo.engines.registry import lora_adapter_sync

    if not lora_adapter_sync(cfg):
        return []
    lora = cfg.model.lora
    modules = peft_config(arch, lora)["target_modules"]
    args = ["--enable-lora", "--max-lora-rank", str(lora.rank), "--max-loras-per-batch", "3",
            "--lora-target-modules", *modules]  # fmt: skip
    if cfg.rollout.sglang.device == "cpu":
        args += ["--lora-backend", "torch_native"]
    return args


def _refuse_data_parallel(args: Sequence[str]) -> None:
    """SGLang's weight-update endpoints assert ``dp_size == 1`` (sglang/srt/managers/tokenizer_control_mixin.py): a
    server with ``--dp-size > 1`` would fail every sync. The check config validation runs for ``dapo launch``'s servers
    (``engines.sglang.options.sglang_data_parallel``); start one server per rollout TP group instead."""
    from megatron_dapo.engines.sglang.options import sglang_data_parallel

    flag = sglang_data_parallel(list(args))
    if flag:
        raise ValueError(
            f"SGLang server argument {flag}: every weight-update endpoint of SGLang 0.5 asserts "
            "dp_size == 1; start one server per rollout TP group instead"
        )


_STARTED: set[SGLangServer] = set()  # running servers this process started (strong refs: stopped even when dropped)


@atexit.register
def _stop_started_servers() -> None:
    """Servers run in their own process group (they outlive us otherwise): stop the ones this process started."""
    for server in list(_STARTED):
        server.stop(timeout=10)


def servers_from_config(cfg, model_path, log_dir=None, server_urls=None) -> list[SGLangServer]:
    """Servers at ``server_urls`` (default ``rollout.server_urls``), attached; or one local server with the rollout
    section's settings, not started yet (on a free port; cluster.server_port is the Slurm launcher's)."""
    r = cfg.rollout
    urls = list(r.server_urls if server_urls is None else server_urls)
    if urls:
        logs = json.loads(os.environ.get("DAPO_SERVER_LOGS") or "{}")  # dapo launch: each server's log file
        return [SGLangServer.attach(u, tp_size=r.sglang.tp, device=r.sglang.device, log_path=logs.get(u)) for u in urls]
    return [
        SGLangServer(
            model_path,
            tp_size=r.sglang.tp,
            mem_fraction=r.mem_fraction,
            memory_saver=r.colocate and r.sglang.device == "cuda",  # torch_memory_saver: CUDA only
            dtype=server_dtype(cfg),
            extra_args=server_args(cfg),
            env=dict(kv.split("=", 1) for kv in r.sglang.env),
            log_path=Path(log_dir) / "sglang_server.log" if log_dir else None,
            device=r.sglang.device,
            pythonpath=r.sglang.pythonpath,
        )
    ]
