"""An SGLang server as a ``dapo launch`` job step (launch/slurm.py asks for these through engines/registry.py): its
command line and its environment."""

from __future__ import annotations

from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.engines.sglang.server import (
    DTYPE_NAMES,
    PLATFORMS,
    server_args,
    server_dtype,
    server_env,
    server_pythonpath,
)


def launch_env(cfg, colocated: bool) -> dict[str, str]:
    """The environment of every server task (``srun --export``): ``server.server_env`` (colocated: with the memory
    saver's variables, as for ``--enable-memory-saver``) and ``rollout.sglang.env``."""
    env = server_env(cfg.rollout.sglang.device, memory_saver=colocated)
    if cfg.rollout.sglang.pythonpath:
        env["PYTHONPATH"] = server_pythonpath(cfg.rollout.sglang.pythonpath)
    return env | dict(kv.split("=", 1) for kv in cfg.rollout.sglang.env)


def launch_command(cfg, python: str, port: int, colocated: bool, host: str, args_file: str, base_gpu_id: int = 0,
                   nccl_port: int | None = None) -> list[str]:  # fmt: skip
    """One engine's ``python -m sglang.launch_server ...`` (its environment: ``launch_env``) behind the wrapper that
    redacts the API key from its output, listening on ``host``, the key in ``args_file`` (``--config``).

    No ``--dp-size``: SGLang's weight-update endpoints assert dp_size == 1, so a data-parallel server could never be
    synced; the server uses ``rollout.sglang.tp`` GPUs of its node from ``--base-gpu-id`` on (it sees all of them, as
    in slime and NeMo-RL): one server per rollout-TP group (launch/placement.py). ``nccl_port``: the job's port for
    SGLang's TP group (its default: a random port above the HTTP port)."""
    r = cfg.rollout
    if not cfg.model.hf_init:
        raise ConfigError("model.hf_init = None: SGLang servers (rollout.engine = 'sglang') need an HF checkpoint dir")
    cmd = [python, "-m", "megatron_dapo.engines.sglang.auth", python, "-m", "sglang.launch_server"]
    cmd += ["--model-path", cfg.model.hf_init, "--host", host, "--config", args_file]
    cmd += ["--port", str(port), "--tp-size", str(r.sglang.tp), "--base-gpu-id", str(base_gpu_id)]
    cmd += ["--mem-fraction-static", str(r.mem_fraction)]
    cmd += ["--dtype", DTYPE_NAMES[server_dtype(cfg)], *PLATFORMS[r.sglang.device].server_args, *server_args(cfg)]
    if colocated and r.sglang.device == "cuda":  # torch_memory_saver: CUDA only (a CPU server frees nothing)
        cmd += ["--enable-memory-saver", *PLATFORMS["cuda"].memory_saver_args]
    if nccl_port is not None:
        cmd += ["--nccl-port", str(nccl_port)]
    return cmd
