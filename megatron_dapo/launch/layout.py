"""What a GPU launch puts where, and whether it fits: the engines and weight-sync routes of ``placement.py`` as the
launch plan shows them, and each phase's predicted peak memory (``plan.evaluate_layout``) for the recipe's layout.

    layout = layout_memory(cfg, nodes=16, gpus_per_node=8)   # plan.Plan of the recipe's TP/PP/CP, micro-batch, SGLang
    check_fits(layout, cfg)                                  # LaunchError naming the phase and the numbers
    describe_layout(plan)                                    # the engines, the per-node sync plan, the phase peaks

Colocated, a GPU holds two phases in turn (``placement.to_rollout()`` / ``to_train()``): *rollout* = the trainer's
weights (grads and optimizer states offloaded to the host) + the SGLang engine's weights and KV cache
(``rollout.mem_fraction`` of the GPU) and its CUDA graphs + overhead; *train* = the trainer's peak + what a released
engine keeps; and once, at *start-up*, before the engines first release, the trainer's whole state beside them. A layout
whose peak exceeds 95% of ``cluster.gpu_mem_gb`` in any of them is refused before any step starts
(``cluster.memory_check = false`` launches it anyway).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_dapo.engines.registry import engine_spec
from megatron_dapo.launch.slurm_env import LaunchError
from megatron_dapo.models.memory import GiB

if TYPE_CHECKING:
    from megatron_dapo.config.run_config import DapoConfig
    from megatron_dapo.launch.placement import Placement
    from megatron_dapo.planning.plans import Plan


def layout_memory(cfg: DapoConfig, nodes: int, gpus_per_node: int) -> Plan:
    """The memory model's verdict on the recipe's own layout (no search): ``Plan.phases`` when colocated."""
    from megatron_dapo.planning.planner import evaluate_layout

    p, r = cfg.parallel, cfg.rollout
    max_new = r.sampling.max_new_tokens
    colocated = cfg.cluster.placement == "colocated"
    spec = engine_spec(r.engine)
    options = dict(
        engine=r.engine,
        colocated=colocated,
        rollout_mem_fraction=r.mem_fraction,
        batch_prompts=cfg.train.batch_prompts,
        group_size=cfg.algo.group_size,
        mini_batch_prompts=cfg.train.mini_batch_prompts,
        logprob_chunk_tokens=p.logprob_chunk_tokens,
        lora_rank=cfg.model.lora.rank,
        lora_targets=tuple(cfg.model.lora.targets),
    )
    if not colocated:
        options["rollout_nodes"] = cfg.cluster.rollout_nodes
    return evaluate_layout(
        cfg.model.arch,
        cfg.data.max_prompt_len,
        max_new,
        nodes,
        gpus_per_node,
        cfg.cluster.gpu_mem_gb,
        tp=p.tp,
        pp=p.pp,
        cp=p.cp,
        micro_batch_tokens=p.max_tokens_per_micro_batch or cfg.data.max_prompt_len + max_new,
        recompute=cfg.model.recompute or "none",
        distributed_optimizer=p.distributed_optimizer is not False,
        fp8=cfg.model.fp8 is not None,
        engine_tp=spec.tp(cfg),
        ep=p.ep,
        **options,
    )


def _top(rows: list[tuple[str, float, str]], n: int = 3) -> str:
    return ", ".join(f"{name} {v / GiB:.1f}" for name, v, _ in sorted(rows, key=lambda row: -row[1])[:n])


def check_fits(layout: Plan, cfg: DapoConfig) -> None:
    """Refuse (LaunchError) a layout the memory model predicts not to fit, naming the phase and its numbers."""
    if layout.feasible or not cfg.cluster.memory_check:
        return
    why = [
        f"{ph.phase} phase: peak {ph.total / GiB:.1f} GiB > {ph.usable / GiB:.1f} GiB usable ({_top(ph.rows)} GiB)"
        for ph in layout.phases
        if not ph.fits
    ]
    phase_reasons = ("training needs", "rollout phase:") if layout.phases else ("rollout phase:",)
    why += [reason for reason in layout.reasons if not reason.startswith(phase_reasons)]
    raise LaunchError(
        f"layout {layout.label()} predicted not to fit {cfg.cluster.gpu_mem_gb:g} GiB GPUs (cluster.gpu_mem_gb): "
        + "; ".join(why)
        + " — see `dapo plan`; cluster.memory_check=false launches it anyway"
    )


def memory_dict(layout: Plan) -> dict:
    return {
        "gpu_mem_gb": layout.gpu_mem_gb,
        "usable_gib": layout.usable_gb,
        "fits": layout.feasible,
        "reasons": list(layout.reasons),
        "phases": {
            ph.phase: {"peak_gib": ph.total / GiB, "terms_gib": {k: v / GiB for k, v, _ in ph.rows}}
            for ph in layout.phases
        },
        "train_gib": layout.memory.total / GiB,
    }


def _ranks(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) else str(ranks)


def describe_engines(placement: Placement, node_names: list[str], ports: list[int]) -> list[str]:
    """One line per engine: node, GPUs/base GPU, TP, port, and the trainer ranks that share its GPUs and feed it."""
    pl = placement
    lines = [
        f"rollout engines: {len(pl.engines)} SGLang servers, TP{pl.rollout_tp} dp 1 (one per rollout-TP group "
        f"of GPUs, --base-gpu-id), {pl.engines_per_node} per node"
    ]
    for e, port in zip(pl.engines, ports):
        line = (
            f"  engine {e.index:3d}  {node_names[e.node]:<12} GPUs {e.gpus.start}-{e.gpus.stop - 1} "
            f"(--base-gpu-id {e.base_gpu_id}, --tp-size {e.tp})  port {port}"
        )
        route = pl.routes[e.index]
        if pl.colocated:
            stages = sorted({pl.coords(r)["pp"] for r in route.senders})
            dps = sorted({pl.coords(r)["dp"] for r in route.senders})
            line += f"  shares its GPUs with trainer ranks {_ranks(list(route.senders))} (DP {dps}, PP stage {stages})"
        lines.append(line)
    return lines


def describe_sync(placement: Placement, node_names: list[str]) -> list[str]:
    pl = placement
    if not pl.colocated:
        return ["weight sync: trainer rank 0 -> every engine over one NCCL group (rollout.weight_sync=distributed)"]
    lines = [
        "weight sync, per node (CUDA IPC: a handle opens only on its own node; no engine gets weights from "
        "another node):"
    ]
    for node in sorted({e.node for e in pl.engines}):
        routes = [r for r in pl.routes if r.node == node]
        parts = [f"engine {r.engine} <- ranks {_ranks(list(r.senders))} (rank {r.poster} posts)" for r in routes]
        lines.append(f"  {node_names[node]}: " + "; ".join(parts))
    if pl.pp_exchange:
        where = "across nodes" if pl.pp_spans_nodes else "inside each node"
        lines.append(
            f"  PP exchange first: PP{pl.pp} stages sit on different {'nodes' if pl.pp_spans_nodes else 'GPUs'}"
            f"; each sending rank receives the other stages' parameters over the trainer's pipeline group "
            f"({where}), so every engine gets the whole model"
        )
    return lines


def describe_memory(layout: Plan) -> list[str]:
    lines = [
        f"memory per GPU (predicted; cluster.gpu_mem_gb {layout.gpu_mem_gb:g}, usable {layout.usable_gb:.1f} GiB; "
        "`dapo plan` explains the terms):"
    ]
    for ph in layout.phases:
        terms = " + ".join(f"{name} {v / GiB:.1f}" for name, v, _ in ph.rows if v)
        lines.append(f"  {ph.phase} phase: {terms} = {ph.total / GiB:.1f} GiB: {'fits' if ph.fits else 'DOES NOT FIT'}")
    if not layout.phases:
        lines.append(f"  train: {layout.memory.total / GiB:.1f} GiB (trainer only: engines on their own nodes)")
    return lines
