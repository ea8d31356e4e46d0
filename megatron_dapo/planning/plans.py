"""The planner's results: a ``Plan`` (a layout, its memory per stage and phase, its step time), the options it was
evaluated under, and how plans are ranked (``rank_plans``, ``choose``). The formulas are in ``planner.py``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from megatron_dapo.engines.registry import GPU_ENGINE
from megatron_dapo.models.memory import RECOMPUTE, GiB, PhaseMemory


class NoFeasiblePlan(ValueError):
    """No candidate fits; the message gives the closest plan and what overflows."""


# ----------------------------------------------------------------------------------------------------------------------
# Plans


@dataclass
class Memory:
    """Per-GPU bytes in the training phase for one pipeline stage."""

    stage: int
    params: int
    weights: float
    fp8_cache: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    rollout: float
    overhead: float
    expert_params: int = 0  # of params, the MoE experts (sharded by the distributed optimizer over DP·CP/EP)
    forward_pass: float = 0.0  # the logprob pass's peak over the resident state (one layer at a time, the logits)
    lora_params: int = 0  # LoRA: the adapters (trained; the params are frozen: weights only, no grads or optimizer)

    @property
    def total(self) -> float:
        return self.resident + self.activations + self.logits + self.rollout + self.overhead

    @property
    def resident(self) -> float:
        """What the trainer keeps between steps: weights, grads, optimizer states."""
        return self.weights + self.fp8_cache + self.grads + self.optimizer


@dataclass
class Rollout:
    """The rollout engines' side: their TP, memory share per GPU and KV-cache capacity per engine (tokens)."""

    colocated: bool
    engine_tp: int
    share: float  # bytes per GPU SGLang may use
    mem_fraction: float
    weights: float  # bytes per GPU
    kv_tokens: int  # per engine
    trainer_resident: float  # bytes the trainer keeps on the GPU during rollout
    # the engine's own terms (engines/registry.py memory_factory; SGLang's: engines/sglang/memory.py SGLangMemory),
    # which give the phase tables their rows (``rows(tp, phase)``)
    engine_terms: Any = None
    tp_key: str = ""  # the config key of the engine's TP (engines/registry.py EngineSpec.tp_key)


@dataclass
class Plan:
    tp: int
    pp: int
    cp: int
    dp: int
    micro_batch_tokens: int
    recompute: str
    distributed_optimizer: bool
    fp8: bool
    gpu_mem_gb: float
    usable_gb: float
    train_gpus: int
    memory: Memory  # worst stage
    stage_totals: dict[int, float]  # bytes, first and last stage (the others are bounded by the first)
    rollout: Rollout | None
    micro_batches_per_update: int
    pipeline_bubble: float
    step_time_s: float
    flops_per_step: float
    feasible: bool = True
    reasons: list[str] = field(default_factory=list)
    model: str = ""
    max_seq_len: int = 0
    phases: list[PhaseMemory] = field(default_factory=list)  # colocated: train, rollout and start-up peaks
    stages: list[Memory] = field(default_factory=list)  # first and last stage; every stage for a chosen layout
    options: PlanOptions | None = None
    ep: int = 1  # expert parallelism (MoE), carved from DP

    @property
    def memory_gib(self) -> float:
        return self.memory.total / GiB

    def label(self) -> str:
        ep = f" EP{self.ep}" if self.ep > 1 else ""
        return (
            f"TP{self.tp} PP{self.pp} CP{self.cp} DP{self.dp}{ep} mb={self.micro_batch_tokens} "
            f"recompute={self.recompute} distopt={'on' if self.distributed_optimizer else 'off'} "
            f"fp8={'on' if self.fp8 else 'off'}"
        )

    def overrides(self) -> list[str]:
        """Dotted config overrides (``load_config(..., overrides=...)``) that apply this plan."""
        out = [
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.cp={self.cp}",
            f"parallel.ep={self.ep}",
            f"parallel.sequence_parallel={'true' if self.tp > 1 else 'false'}",
            f"parallel.distributed_optimizer={'true' if self.distributed_optimizer else 'false'}",
            f"parallel.max_tokens_per_micro_batch={self.micro_batch_tokens}",
            f"model.recompute={'null' if self.recompute == 'none' else self.recompute}",
            f"model.fp8={'e4m3' if self.fp8 else 'null'}",
        ]
        if self.rollout is not None:
            out += [
                f"{self.rollout.tp_key}={self.rollout.engine_tp}",
                # rounded down: the start-up phase is sized with this share, and rounding up can overflow it
                f"rollout.mem_fraction={math.floor(self.rollout.mem_fraction * 100) / 100:.2f}",
            ]
        return out

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["memory_total_gib"] = self.memory_gib
        return d

    def explain(self) -> str:
        m, gib = self.memory, GiB
        params_b = m.params / 1e9
        opt_div = self.dp * self.cp if self.distributed_optimizer else 1
        rows = [
            ("weights", m.weights, f"{params_b:.2f} B params × 2 B (bf16)"),
            ("fp8 weight cache", m.fp8_cache, "GEMM weights × 2 B (FP8 copy + transpose)"),
            ("gradients", m.grads, "params × 4 B (fp32 main grads)"),
            (
                "optimizer",
                m.optimizer,
                f"params × 12 B / {opt_div} (fp32 master + 2 Adam moments)"
                + (
                    f"; experts ({m.expert_params / 1e9:.2f} B) / {opt_div // self.ep}"
                    if m.expert_params and self.distributed_optimizer
                    else ""
                ),
            ),  # fmt: skip
            ("activations", m.activations, f"{self.recompute} recompute, {self.micro_batch_tokens // self.cp} tok/GPU"),
            ("logits chunk", m.logits, "chunk × vocab/TP × 10 B + final hidden states (last stage)"),
            ("rollout (SGLang)", m.rollout, "resident during training"),
            ("overhead", m.overhead, "CUDA context, NCCL, fragmentation"),
        ]
        verdict = "fits" if self.feasible else "DOES NOT FIT"
        lines = [
            f"{self.model}: {self.label()}  ({self.train_gpus} training GPUs, max sequence {self.max_seq_len})",
            f"training-phase memory per GPU, worst stage {m.stage} of {self.pp} (GiB):",
        ]
        lines += [f"  {name:<18}{value / gib:8.2f}   {why}" for name, value, why in rows]
        lines.append(
            f"  {'total':<18}{m.total / gib:8.2f}   of {self.usable_gb:.1f} GiB usable "
            f"({self.usable_gb / self.gpu_mem_gb:.0%} of {self.gpu_mem_gb:g}): {verdict}"
        )
        if len(self.stage_totals) > 1:
            lines.append("  per stage: " + ", ".join(f"{k}: {v / gib:.2f}" for k, v in self.stage_totals.items()))
        r = self.rollout
        if r is not None:
            where = "colocated" if r.colocated else "separate nodes"
            meanwhile = f"; trainer keeps {r.trainer_resident / gib:.1f} GiB meanwhile" if r.colocated else ""
            lines.append(
                f"rollout ({where}): SGLang TP{r.engine_tp}, share {r.share / gib:.1f} GiB/GPU "
                f"(mem_fraction {r.mem_fraction:.2f}), weights {r.weights / gib:.1f} GiB, KV cache "
                f"{r.kv_tokens:,} tokens/engine{meanwhile}"
            )
        for ph in self.phases if r is not None and r.colocated else []:
            lines.append(ph.explain())
        lines.append(
            f"time: {self.micro_batches_per_update} micro-batches/update/DP rank, pipeline bubble "
            f"{self.pipeline_bubble:.1%}, {self.flops_per_step / 1e18:.2f} EFLOP/step → ≈{self.step_time_s:.0f} s "
            "per training step (excluding rollout)"
        )
        lines += [f"  ✗ {reason}" for reason in self.reasons]
        return "\n".join(lines)


@dataclass(frozen=True)
class PlanOptions:
    """The knobs of ``plan`` (keyword arguments) besides the model and the cluster."""

    engine: str = GPU_ENGINE  # rollout.engine: whose memory model sizes the rollout side (engines/registry.py)
    colocated: bool = True  # SGLang and training share the GPUs; else SGLang runs on ``rollout_nodes``
    rollout_nodes: int | None = None  # disaggregated only; default half the nodes
    rollout_mem_fraction: float | None = None  # SGLang's share; None: colocated = what the trainer leaves, else 0.85
    rollout_release: bool = True  # colocated SGLang releases weights + KV cache while the actor trains
    rollout_residual_gb: float = 2.0  # what a released SGLang still holds (CUDA context, allocator, what it keeps)
    # SGLang's CUDA graphs: the rehearsal's; the planner takes SGLang's own estimate (engines/sglang/memory.py:
    # 2 MB × cuda_graph_max_bs, 512 at TP >= 4 on an H100)
    cuda_graph_gb: float = 1.0
    offload_train_state: bool = True  # colocated: grads + optimizer states on the host during rollout (weights stay)
    min_rollout_seqs: int = 16  # full-length sequences an SGLang engine's KV cache must hold
    # an engine's weights may take at most this share of its memory (the rest: KV cache, SGLang's activations)
    rollout_weight_share: float = 0.8
    batch_prompts: int = 512  # B
    group_size: int = 16  # G
    mini_batch_prompts: int = 32  # prompts per optimizer update
    mean_seq_len: float | None = None  # prompt + response, for the time estimate; default a quarter of the maximum
    logprob_chunk_tokens: int = 1024  # 0 = the actor materializes the logits of a whole micro-batch
    overhead_gb: float = 5.0  # the trainer's CUDA context, NCCL, fragmentation (SGLang's: engines/sglang/memory.py)
    usable_fraction: float = 0.95  # a plan must fit in this fraction of the GPU
    fp8_options: tuple[bool, ...] = (False, True)
    flash: bool = True  # fused / flash attention (always with TE; CP needs it)
    peak_tflops: float = 989.0  # dense bf16 per GPU (H100 SXM)
    mfu: float = 0.40
    fp8_speedup: float = 1.3
    dp_bandwidth_gbs: float = 40.0  # per GPU for the gradient collectives across nodes (×8 inside one node)
    micro_batch_multiples: tuple[int, ...] = (1, 2, 4)  # micro-batch token budgets, × the max sequence length
    routing_replay: bool = True  # MoE: rollout routing replay (the actor replays at CP 1 only)
    moe_imbalance: float = 1.25  # MoE: the busiest EP rank's routed tokens over the mean (dropless, aux loss on)
    ep_bandwidth_gbs: float = 150.0  # MoE: per GPU for the alltoall inside a node (NVLink), across nodes dp_bandwidth
    lora_rank: int = 0  # LoRA (model.lora): the base frozen, adapters of this rank on ``lora_targets`` trained
    lora_targets: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def rank_plans(plans: list[Plan]) -> list[Plan]:
    """Feasible first by time (1% buckets), then fewer model-parallel GPUs, smaller PP, smaller TP, distributed
    optimizer, less recompute, larger micro-batches; infeasible after, by memory overflow."""

    def key(p: Plan):
        if not p.feasible:
            return (1, p.memory.total, len(p.reasons))
        return (
            0,
            round(math.log(p.step_time_s) / math.log(1.01)),
            p.tp * p.pp * p.cp,
            p.pp,
            p.tp,
            not p.distributed_optimizer,
            RECOMPUTE.index(p.recompute),
            -p.micro_batch_tokens,
        )

    return sorted(plans, key=key)


def choose(plans: list[Plan]) -> Plan:
    """The best feasible plan, or NoFeasiblePlan naming the closest candidate and why it fails."""
    for p in plans:
        if p.feasible:
            return p
    if not plans:
        raise NoFeasiblePlan("no candidate plans (the GPU count cannot be split into TP × PP × CP × DP)")
    closest = min(plans, key=lambda p: p.memory.total)
    raise NoFeasiblePlan(
        f"no plan fits {closest.train_gpus} GPUs × {closest.gpu_mem_gb:g} GiB for {closest.model} at "
        f"{closest.max_seq_len} tokens; the closest, {closest.label()}: " + "; ".join(closest.reasons)
    )
