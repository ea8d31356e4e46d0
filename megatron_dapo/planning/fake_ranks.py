"""Every rank of a GPU layout, built on a CPU: torch's fake process group + megatron-core's real ``parallel_state``
+ our real model provider on the meta device.

    ranks = build_ranks(cfg, arch, world=128)     # one RankBuild per global rank; a model per (tp, cp, pp) position

The fake process group (``torch.testing._internal.distributed.fake_pg``: ``FakeStore`` and the "fake" backend)
lets one process be any rank of any world size: collectives return at once without moving data. megatron-core's
``initialize_model_parallel(..., create_gloo_process_groups=False)`` accepts it, so the tensor/pipeline/data ranks a
rank gets are megatron's own, not our reading of its rank order. The model is built by ``actor.provider.build_model``
under ``torch.device("meta")``: shapes and dtypes are exact, no memory is touched.

What the CPU cannot build is the Transformer Engine layer spec. The local spec has the same parameters (TE fuses the
pre-attention and pre-MLP norms into ``linear_qkv`` / ``linear_fc1`` as ``layer_norm_weight``: same shapes, other
names), and sequence parallelism, context parallelism and FP8 add none, so the build runs with them off and the
counts stand for the GPU job (an MoE model under TP is built as for a forward: training it needs SP, which the CPU
cannot run); FP8's weight copies are counted from the GEMM weights found here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_dapo.config.run_config import DapoConfig
from megatron_dapo.models.arch import ArchConfig

# The GEMM weights TE keeps an FP8 copy (and transpose) of: megatron-core's names in both layer specs.
GEMM_SUFFIXES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


@dataclass(frozen=True)
class RankBuild:
    """One global rank as megatron-core places it, and what its model holds (exact, from the meta build)."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    params: int  # parameters this rank holds
    param_bytes: int  # in the model's dtype
    gemm_params: int  # of which the four GEMM weights of its layers (FP8 keeps a copy and a transpose of these)
    first_stage: bool
    last_stage: bool
    ep: int = 0  # expert-parallel rank (MoE; EP is carved from the data-parallel ranks)
    expert_params: int = 0  # of params, the MoE experts this rank holds
    trainable_params: int | None = None  # those that train (LoRA: the adapters); None = all

    def coords(self) -> dict[str, int]:
        """The dense coordinates the launch's placement assumes (EP lives inside DP)."""
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}


@contextlib.contextmanager
def fake_rank(
    rank: int, world: int, tp: int, pp: int, cp: int = 1, ep: int = 1, gloo_groups: bool = False
) -> Iterator[None]:
    """This process is ``rank`` of ``world`` until the block ends: a fake default group and megatron-core's model-
    parallel groups over it (``gloo_groups``: its gloo groups too, which the distributed optimizer needs; the caller
    makes them fake, ``rank_step.rehearsal_world``). Nothing else may hold torch.distributed at the time."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("fake_rank: torch.distributed is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=tp,  # expert TP = TP, as the actor (actor/distributed.py)
            create_gloo_process_groups=gloo_groups,
        )
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def buildable_here(cfg: DapoConfig):
    """(model, parallel) sections the CPU can build with the same parameters as the GPU job (module docstring)."""
    model = dataclasses.replace(cfg.model, transformer_impl="local", fp8=None)
    parallel = dataclasses.replace(cfg.parallel, sequence_parallel=False, cp=1)
    return model, parallel


def rank_coords(rank: int, world: int, cfg: DapoConfig) -> dict[str, int]:
    """megatron-core's (tp, cp, dp, pp) ranks of global ``rank``, from its own ``parallel_state``."""

    p = cfg.parallel
    with fake_rank(rank, world, p.tp, p.pp, p.cp, p.ep):
        return _coords()


def _coords() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return dict(
        tp=ps.get_tensor_model_parallel_rank(),
        cp=ps.get_context_parallel_rank(),
        dp=ps.get_data_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_rank(),
    )


def build_rank(rank: int, world: int, cfg: DapoConfig, arch: ArchConfig) -> RankBuild:
    """Build ``rank`` of ``world`` on the meta device and describe it."""
    from megatron.core import parallel_state as ps

    from megatron_dapo.actor.cpu import apply_cpu_shims
    from megatron_dapo.actor.provider import build_model

    apply_cpu_shims()
    p = cfg.parallel
    model_cfg, parallel = buildable_here(cfg)
    with fake_rank(rank, world, p.tp, p.pp, p.cp, p.ep):
        coords = _coords()
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")  # megatron-core: "Apex is not installed" per module
            chunks = build_model(arch, model_cfg, parallel, training=not arch.is_moe)  # MoE + TP: SP (module doc)
            if cfg.model.lora.rank:  # as the actor does (actor.py): the adapters, the base frozen
                from megatron_dapo.actor.lora import apply_lora

                apply_lora(chunks, cfg.model.lora, p.sequence_parallel, cfg.train.seed)
    named = [(n, t) for chunk in chunks for n, t in chunk.named_parameters()]
    if any(t.device.type != "meta" for _, t in named):
        raise RuntimeError(f"rank {rank}: the model was not built on the meta device")
    return RankBuild(
        rank=rank,
        **coords,
        params=sum(t.numel() for _, t in named),
        param_bytes=sum(t.numel() * t.element_size() for _, t in named),
        gemm_params=sum(t.numel() for n, t in named if n.endswith(GEMM_SUFFIXES)),
        expert_params=sum(t.numel() for n, t in named if ".mlp.experts." in n),
        trainable_params=sum(t.numel() for _, t in named if t.requires_grad),
        first_stage=first,
        last_stage=last,
    )


def build_ranks(
    cfg: DapoConfig, arch: ArchConfig, world: int, progress=None, every_rank: bool = False
) -> list[RankBuild]:
    """Every rank of ``world``, one after another, each with its own megatron-core coordinates; ``progress(i, world)``
    after each. The model is built once per model-parallel position (tp, cp, pp) and reused for the data-parallel
    replicas of that position, which hold the same parameters (``every_rank``: build every rank's own); with EP,
    per (tp, cp, pp, ep) position: each expert-parallel rank holds other experts."""
    out: list[RankBuild] = []
    built: dict[tuple[int, int, int, int], RankBuild] = {}
    for rank in range(world):
        coords = rank_coords(rank, world, cfg)
        key = (coords["tp"], coords["cp"], coords["pp"], coords["ep"])
        if every_rank or key not in built:
            b = build_rank(rank, world, cfg, arch)
            built.setdefault(key, b)
        else:
            b = dataclasses.replace(built[key], rank=rank, dp=coords["dp"])
        out.append(b)
        if progress is not None:
            progress(rank + 1, world)
    return out
