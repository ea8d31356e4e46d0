"""A train step's metrics, combined over every rank's micro-batches on the actor's host (gloo) group."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_dapo.actor.gather import all_gather_small
from megatron_dapo.algo.loss import LOSS_METRIC_REDUCTIONS, combine_loss_metrics


@dataclass
class StepTally:
    """What a step's updates add up on this rank (``MegatronActor.update_mini_batch``), read by ``finish_step``."""

    started: float  # perf_counter at the step's start
    streamed: bool = False  # train.stream_updates: the updates waited for their groups in between
    update_seconds: float = 0.0  # streamed: the updates' own time
    old_seconds: float = 0.0  # the π_old pass
    old_pass_seqs: int = 0
    updates: int = 0
    micro_batches: int = 0
    tokens: int = 0
    parts: list = field(default_factory=list)  # per-micro-batch loss metrics (last stage, TP rank 0)
    losses: list = field(default_factory=list)  # per-update loss sums
    grad_norms: list = field(default_factory=list)
    covered: list = field(default_factory=lambda: [0, 0])  # routing replay: positions with a route, all of them
    replay_metrics: dict = field(default_factory=dict)


def step_metrics(actor, parts, losses, grad_norms, tokens, seconds) -> dict[str, float]:
    """``parts``: this rank's per-micro-batch loss metrics (last stage, TP rank 0; empty elsewhere), ``losses``: its
    per-update loss sums, ``tokens``: its micro-batch tokens; the same metrics on every rank."""
    local = [{k: r[k].cpu() for k in LOSS_METRIC_REDUCTIONS} for r in parts]
    gathered = all_gather_small((local, sum(losses), tokens), actor.gloo)
    all_parts = [p for g in gathered for p in g[0]]
    m = combine_loss_metrics(all_parts) if all_parts else {}
    # loss: sum over ranks of the local sums of per-micro-batch losses, averaged over the updates
    loss = sum(g[1] for g in gathered if g) / actor.cfg.num_updates
    total_tokens = sum(g[2] for g in gathered) / max(1, actor.cfg.parallel.tp * actor.cfg.parallel.pp)
    tis = {}
    if actor.cfg.tis_possible:
        keys = ("tis_mean", "tis_capped_frac", "tis_max", "tis_min", "tis_token_frac", "tis_masked_frac")
        tis = {f"train/{k}": float(m.get(k, 0.0)) for k in keys}
    return {
        **tis,
        "train/loss": loss,
        "train/clip_frac_low": float(m.get("clip_frac_low", 0.0)),
        "train/clip_frac_high": float(m.get("clip_frac_high", 0.0)),
        "train/clip_frac_dual": float(m.get("clip_frac_dual", 0.0)),
        "train/ppo_kl": float(m.get("ppo_kl", 0.0)),
        "train/ratio_mean": float(m.get("ratio_mean", 1.0)),
        "train/ratio_max": float(m.get("ratio_max", 1.0)),
        "train/ratio_min": float(m.get("ratio_min", 1.0)),
        "train/grad_norm": sum(grad_norms) / len(grad_norms),
        "train/lr": actor.lr,
        "train/skipped_updates": float(actor.skipped_updates),
        "perf/tokens_per_s": total_tokens / seconds if seconds > 0 else 0.0,
        "perf/packing_efficiency": 1.0 / (1.0 + actor.last_balance.padding_waste),
        "perf/dp_imbalance": actor.last_balance.imbalance,
    }
