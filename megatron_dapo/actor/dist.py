"""Process-group set-up from torchrun / srun environment variables, and seeding."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from megatron_dapo.actor.cpu import apply_cpu_shims
from megatron_dapo.config.run_config import ParallelConfig
from megatron_dapo.config.validate import check_world_divides


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (for rendezvous, servers and NCCL groups)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def env_rank_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's RANK/WORLD_SIZE/LOCAL_RANK or Slurm's SLURM_PROCID/NTASKS."""
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"]), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0"))
    if "SLURM_PROCID" in env and "MASTER_ADDR" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", "0"))
    return 0, 1, 0


def init_distributed(parallel: ParallelConfig, timeout_s: float = 600.0) -> None:
    """torch.distributed (gloo on CPU, nccl on GPU) and megatron-core's parallel_state with TP/PP/CP; DP = the rest."""
    from megatron.core import parallel_state

    apply_cpu_shims()
    rank, world, local_rank = env_rank_world()
    if dist.is_initialized():  # a caller's group (the tests' torchrun groups, the rehearsal's fake one)
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        # A lone process (no torchrun/srun) rendezvouses on a free local port, without touching os.environ (which
        # child processes would inherit).
        init_method = None if "MASTER_ADDR" in os.environ else f"tcp://127.0.0.1:{free_port()}"
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    check_world_divides(parallel, world)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.tp,
        # megatron-core's own groups (TP, PP, DP, ...) take this, not the default group's timeout: 30 min unless told
        # (parallel_state.py initialize_model_parallel, `timeout = timedelta(minutes=distributed_timeout_minutes)`)
        distributed_timeout_minutes=timeout_s / 60,
    )


def seed_everything(seed: int) -> None:
    """Same seed on every rank for replicated init; megatron's tracker gets the per-TP-rank model-parallel stream."""
    from megatron.core import parallel_state, tensor_parallel

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    # Offsets as in megatron-core's model_parallel_cuda_manual_seed.
    tracker.add("model-parallel-rng", seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
    tracker.add("data-parallel-rng", seed)
    tracker.add("expert-parallel-rng", seed + 1024 + 100 * parallel_state.get_expert_model_parallel_rank())


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def teardown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
