"""A vLLM server as a ``dapo launch`` job step (launch/slurm.py asks for these through engines/registry.py): its
command line and its environment."""

from __future__ import annotations

from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.engines.sglang.server import server_pythonpath
from megatron_dapo.engines.vllm.server import (
    DTYPE_NAMES,
    PLATFORM_ARGS,
    GiB,
    common_args,
    package_root,
    server_args,
    server_dtype,
    server_env,
)


def launch_env(cfg, colocated: bool) -> dict[str, str]:
    """The environment of every server task (``srun --export``): dev mode (the sync's routes), this package on the
    PYTHONPATH (the worker extension and the guard), ``rollout.vllm.env``."""
    env = server_env(cfg.rollout.vllm.device) | {"PYTHONPATH": server_pythonpath([package_root()])}
    return env | dict(kv.split("=", 1) for kv in cfg.rollout.vllm.env)


def launch_command(cfg, python: str, port: int, colocated: bool, host: str, args_file: str, base_gpu_id: int = 0,
                   nccl_port: int | None = None) -> list[str]:  # fmt: skip
    """One engine's ``python -m vllm.entrypoints.openai.api_server ...`` behind the wrapper that redacts the API key
    from its output, the key in ``args_file`` (``--config``). ``python`` runs the wrapper; the server runs from
    ``rollout.vllm.python`` when set. vLLM has no --base-gpu-id (it uses the first ``tp`` visible GPUs): the command
    begins with ``env CUDA_VISIBLE_DEVICES=<its tp GPUs from base_gpu_id>``, so servers of one node (TP < GPUs per
    node) use distinct GPUs. ``nccl_port`` is unused (vLLM's TP group takes a free port of its own)."""
    r, v = cfg.rollout, cfg.rollout.vllm
    if not cfg.model.hf_init:
        raise ConfigError("model.hf_init = None: vLLM servers (rollout.engine = 'vllm') need an HF checkpoint dir")
    server_python = v.python or python
    gpus = ",".join(str(base_gpu_id + i) for i in range(v.tp))
    cmd = ["env", f"CUDA_VISIBLE_DEVICES={gpus}"] if v.device == "cuda" else []
    cmd += [
        python,
        "-m",
        "megatron_dapo.engines.sglang.auth",
        server_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    cmd += common_args(cfg.model.hf_init, host, port, v.tp, r.mem_fraction)
    cmd += ["--dtype", DTYPE_NAMES[server_dtype(cfg)], *PLATFORM_ARGS[v.device], *server_args(cfg)]
    if v.kv_cache_gib:
        cmd += ["--kv-cache-memory-bytes", str(int(v.kv_cache_gib * GiB))]
    if colocated and v.device == "cuda":  # sleep mode: CUDA only
        cmd.append("--enable-sleep-mode")
    return cmd + ["--config", args_file]
