"""``dapo rehearse``: the GPU job at its real size on a CPU, in minutes, with no checkpoint, tokenizer or data.

    dapo rehearse --recipe dapo_32b --nodes 16 [key=value ...]

1. Every trainer rank of the layout is built (``fake_ranks.build_ranks``: the fake process group, megatron-core's
   own ``parallel_state``, our provider on the meta device). Each rank's coordinates must be the ones the launch's
   placement assumes (``launch.placement.Placement.coords``: who shares a GPU with which engine, who sends which
   weights), and its exact parameter count the planner's (``memory.count_params``).
2. The weight sync and the final export as they run (``bridge.export.export_plan``: the bridge's HF tensors in the
   export's own buckets at ``rollout.bucket_mb``, the shards, each rank's bytes in flight), which ranks feed which
   engine (the placement's routes), and the old-logprob gather's bytes (``actor.gather.logprob_gather_bytes``).
3. A table per rank class (pipeline stage × role: the driver, a rank that posts an engine's weights, a rank that only
   sends) and phase — start-up, rollout, sync, old logprobs, train, export — with each term from the built model
   beside the memory model's (``plan.evaluate_layout``, what ``dapo launch`` checks). It fails, naming the rank class,
   the phase and the term, where a phase exceeds the usable GPU memory or the two sides differ by more than
   ``MARGIN``.

What it does not rehearse: kernels (TE, FP8), NCCL and CUDA IPC themselves, real allocator fragmentation, and the
activations (taken from the memory model on both sides: a meta forward keeps no tensors to count).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from megatron_dapo.config.run_config import DapoConfig, load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.engines.registry import engine_spec, lora_adapter_sync
from megatron_dapo.models.arch import load_arch
from megatron_dapo.models.memory import BF16, FP32, GiB, count_params, expert_params, lora_params, total_params
from megatron_dapo.planning.fake_ranks import RankBuild, build_ranks

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}  # model.dtype -> bytes a parameter
MARGIN = 0.02  # the built model and the memory model must agree on every term within 2%
STEP_MARGIN = 0.10  # a term measured by the step (torch's accounting) and the memory model: within 10%
PHASES = ("startup", "rollout", "sync", "old_logprobs", "train", "export")


@dataclass
class Term:
    name: str
    rehearsed: float  # bytes, from the built ranks / the bridge / the config
    model: float | None  # bytes the memory model predicts; None where it has no such term
    why: str = ""
    margin: float = MARGIN  # STEP_MARGIN where ``rehearsed`` was measured by the step
    bound: bool = False  # ``model`` is an upper bound (``export_plan``'s worst tensor order): only exceeding it fails

    def disagrees(self) -> bool:
        if self.model is None:
            return False
        if self.bound:
            return self.rehearsed > self.model * (1 + self.margin)
        return abs(self.rehearsed - self.model) > self.margin * max(abs(self.model), abs(self.rehearsed), 1.0)


@dataclass
class PhaseRow:
    phase: str
    terms: list[Term]

    @property
    def rehearsed(self) -> float:
        return sum(t.rehearsed for t in self.terms)

    @property
    def model(self) -> float:
        return sum(t.rehearsed if t.model is None else t.model for t in self.terms)


@dataclass
class RankClass:
    stage: int
    role: str  # driver | poster | sender | trainer
    ranks: list[int]
    build: RankBuild  # the first rank's (all ranks of a class hold the same parameters: checked)
    phases: list[PhaseRow] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"PP stage {self.stage}, {self.role}"


@dataclass
class SyncPlan:
    """One weight sync and the final export (``bridge.export.export_plan``: the export's own bucketing of the HF
    tensors of the bridge's mapping table) with the placement's routes, and the old-logprob gather's bytes."""

    export: Any  # bridge.export.ExportPlan: tensors, bytes, buckets, shards, peak bytes per rank
    gather: Any  # actor.gather.GatherBytes of the old-logprob pass, every response at full length
    routes: list[dict]
    concurrency: int = 0  # requests the SGLang engine keeps in flight on each server (0: not SGLang)
    adapter_tensors: int = (
        0  # LoRA adapter-only sync (engines.registry.lora_adapter_sync): what each sync sends instead
    )
    adapter_bytes: int = 0

    @property
    def largest(self) -> int:
        """The largest bucket a sync holds (the adapters: one folder's worth, gathered on rank 0)."""
        return self.adapter_bytes if self.adapter_tensors else self.export.max_bucket_bytes

    @property
    def model_bytes(self) -> int:
        return self.export.total_bytes


@dataclass
class Rehearsal:
    recipe: str
    nodes: int
    gpus_per_node: int
    world: int
    usable: float
    classes: list[RankClass]
    sync: SyncPlan
    failures: list[str]
    seconds: float
    layout_label: str
    steps: dict = field(default_factory=dict)  # rank -> rank_step.RankStep, where the step ran (``step=True``)
    control: dict = field(default_factory=dict)  # schedule -> {rank: collectives in order} (planning/control_walk.py)

    @property
    def ok(self) -> bool:
        return not self.failures


def sync_plan(cfg: DapoConfig, arch, placement) -> SyncPlan:
    """The weight sync's buckets, the final export's peaks and the old-logprob gather's bytes for ``cfg``'s layout."""
    from megatron_dapo.actor.gather import logprob_gather_bytes
    from megatron_dapo.bridge.export import export_plan

    p = cfg.parallel
    export = export_plan(arch, p.tp, p.pp, cfg.model.dtype, cfg.rollout.bucket_mb << 20)
    samples = cfg.train.batch_prompts * cfg.algo.group_size
    gather = logprob_gather_bytes(
        samples * cfg.rollout.sampling.max_new_tokens, dp=placement.dp, tp=p.tp, pp=p.pp, cp=p.cp
    )
    routes = [
        {"engine": r.engine, "node": r.node, "senders": list(r.senders), "poster": r.poster, "transport": r.transport}
        for r in placement.routes
    ]
    concurrency = engine_spec(cfg.rollout.engine).per_server_concurrency(cfg)
    plan = SyncPlan(export, gather, routes, concurrency)
    if lora_adapter_sync(cfg):
        from megatron_dapo.bridge.peft import peft_config

        lora = cfg.model.lora
        plan.adapter_tensors = 2 * len(peft_config(arch, lora)["target_modules"]) * arch.num_layers
        dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
        plan.adapter_bytes = dtype_bytes * lora_params(arch, lora.rank, targets=tuple(lora.targets))
    return plan


def _role(rank: int, placement) -> str:
    if rank == 0:
        return "driver"
    if not placement.colocated:
        return "trainer"
    routes = placement.routes_from(rank)
    if any(r.poster == rank for r in routes):
        return "poster"
    return "sender" if routes else "trainer"


def _phases(cls: RankClass, cfg: DapoConfig, layout, sync: SyncPlan, step=None) -> list[PhaseRow]:
    """Each phase's terms on one GPU of ``cls``: built-model bytes beside the memory model's (``layout``: plan.Plan);
    with ``step`` (its stage's ``rank_step.RankStep``), the trainer's terms as the step measured them."""
    b, o, r = cls.build, layout.options, layout.rollout
    stage = next(m for m in layout.stages if m.stage == b.pp)  # evaluate_layout models every stage
    colocated = cfg.cluster.placement == "colocated"
    fp8 = 2.0 * b.gemm_params if cfg.model.fp8 else 0.0
    opt_div = layout.dp * layout.cp if layout.distributed_optimizer else 1
    expert_div = opt_div // layout.ep if layout.distributed_optimizer else 1  # experts: over DP·CP/EP replicas
    # every parameter in the model's dtype: megatron-core's Float16Module casts the built model (the local spec's
    # norms are built in fp32 here: param_bytes differs by their few bytes)
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    weights = Term(
        "trainer weights",
        dtype_bytes * b.params + fp8,
        stage.weights + stage.fp8_cache,
        f"{b.params:,} params" + (" + FP8 copy and transpose of the GEMM weights" if fp8 else ""),
    )
    trained = b.params if b.trainable_params is None else b.trainable_params  # LoRA: the adapters only
    experts = b.expert_params if trained == b.params else 0  # (a mixture's experts carry no adapters)
    lora = "" if trained == b.params else f" of the {trained:,} adapter params (LoRA)"
    grads = Term("trainer grads", FP32 * trained, stage.grads, "fp32 main-grad buffer" + lora)
    optim = Term(
        "trainer optimizer",
        12.0 * ((trained - experts) / opt_div + experts / expert_div),
        stage.optimizer,
        f"fp32 master + Adam / {opt_div}" + (f", experts / {expert_div}" if experts else "") + lora,
    )
    acts = Term("trainer activations", stage.activations, stage.activations, "memory model (not built on meta)")
    logits = Term("trainer logits", stage.logits, stage.logits, "memory model")
    overhead = Term("overhead", o.overhead_gb * GiB, o.overhead_gb * GiB, "CUDA context, NCCL, fragmentation")
    sg = r.engine_terms  # the engine's own sizing (engines/<engine>/memory.py, each term cited from its code)
    name = sg.LABEL
    released = Term(f"{name} (released)", o.rollout_residual_gb * GiB, stage.rollout, "context, allocator")
    engine_weights = Term(f"{name} weights", sync.model_bytes / r.engine_tp, sg.weights, f"HF model / TP{r.engine_tp}")
    kv = Term(
        f"{name} KV cache", sg.kv_cache, sg.kv_cache, f"mem_fraction {sg.mem_fraction:.2f}: {sg.kv_tokens:,} tokens"
    )
    others = sg.rollout - sg.weights - sg.kv_cache - sg.activations
    graphs = Term(f"{name} outside mem_fraction", others, others, f"request table, CUDA graphs, runtime ({name}'s)")
    prefill = Term(f"{name} activations", sg.activations, sg.activations, f"{name}'s reserve for a prefill chunk")
    bucket = Term("sync bucket + flat copy", 2.0 * sync.largest, None, "largest bucket and its flattened copy")
    ex = sync.export
    in_flight = ex.rank0_device_bytes if cls.role == "driver" else ex.other_device_bytes
    export = Term("export in flight", float(in_flight), None, "a bucket + the parameter being gathered (export_plan)")
    gather = Term("old-logprob gather", float(sync.gather.device), None, "on the host over gloo (actor/gather.py)")
    logprob_pass = Term("logprob pass", stage.logits, stage.logits, "memory model")
    if step is not None:  # the trainer's terms as torch's accounting saw them in the step (rank_step.py)
        weights, grads, optim, acts, logits, logprob_pass, export = _measured_terms(
            step, stage, weights, grads, optim, export, fp8, cfg.model.transformer_impl == "local"
        )
    zero = lambda name, why: Term(name, 0.0, 0.0, why)  # noqa: E731
    off_grads, off_optim = zero("trainer grads", "on the host"), zero("trainer optimizer", "on the host")
    if not colocated:  # the engines live on other nodes: the trainer's GPU holds the trainer only
        train = [weights, grads, optim, acts, logits, overhead]
        return [
            PhaseRow("startup", [weights, grads, optim, overhead]),
            PhaseRow("train", train),
            PhaseRow("sync", [weights, grads, optim, bucket, overhead]),
            PhaseRow("old_logprobs", [weights, grads, optim, logprob_pass, gather, overhead]),
            PhaseRow("export", [weights, grads, optim, export, overhead]),
        ]
    return [
        PhaseRow("startup", [weights, grads, optim, engine_weights, kv, graphs, overhead]),
        PhaseRow("rollout", [weights, off_grads, off_optim, engine_weights, kv, graphs, prefill, overhead]),
        # the KV cache and graphs come back after the sync (loop/phases.py AFTER_SYNC)
        PhaseRow("sync", [weights, off_grads, off_optim, engine_weights, bucket, overhead]),
        PhaseRow("old_logprobs", [weights, grads, optim, logprob_pass, gather, released, overhead]),
        PhaseRow("train", [weights, grads, optim, acts, logits, released, overhead]),
        # the run's last step evaluates (the engines resume their KV cache and graphs) before it saves and exports
        PhaseRow("export", [weights, off_grads, off_optim, engine_weights, kv, graphs, export, overhead]),
    ]


def _measured_terms(step, stage, weights: Term, grads: Term, optim: Term, export: Term, fp8: float, local: bool):
    """The trainer's terms from a ``rank_step.RankStep``: the resident state read from the live objects after the
    step, and each phase's peak over it, beside the memory model (``STEP_MARGIN``). ``local``: megatron-core's local
    layers (``model.transformer_impl``); the forward pass's model is TE's path, whose head holds two more hidden-size
    copies per token (measured: dapo_32b_lora's head 1.01 GiB against 1.44): an upper bound there."""

    def measured(name: str, value: float, model: float, why: str) -> Term:
        return Term(name, float(value), model, "measured: " + why, STEP_MARGIN)

    tokens = f"{step.micro_batches} micro-batches of {step.micro_batch_tokens:,} tokens"
    return (
        measured("trainer weights", step.parts["weights"] + fp8, weights.model, "parameters" + (" + FP8 (model)" if fp8 else "")),
        measured("trainer grads", step.parts["grads"], grads.model, "DDP's grad buffers"),
        measured("trainer optimizer", step.parts["optimizer"], optim.model, "fp32 master + Adam moments, this shard"),
        measured("trainer activations + logits", step.transient("train"), stage.activations + stage.logits,
                 f"the update's peak over the resident state ({tokens})"),
        Term("trainer logits", 0.0, 0.0, "in the term above"),
        dataclasses.replace(
            measured("logprob pass", step.transient("old_logprobs"), stage.forward_pass,
                     "the forward-only pass's peak over the resident state" + ("; model: TE's, a bound" if local else "")),
            bound=local),
        dataclasses.replace(
            measured("export in flight", step.transient("export"), export.rehearsed,
                     "the export's peak over the resident state; model: export_plan's bound"), bound=True),
    )  # fmt: skip


def step_ranks(builds) -> list[int]:
    """The ranks whose step stands for their stage: global rank 0 (the export's receiver) and the first rank (its
    sender) of stage 1 and of the last stage. The other ranks of a stage hold the same parameters, train the same
    micro-batches and send less in the export; a middle stage after the first holds stage 1's parameters and fewer
    micro-batches in flight (1F1B), so stage 1 bounds it and it keeps the model's terms (an MoE recipe at PP 8: 3
    steps of about 15 minutes each on 2 cores instead of 8)."""
    first: dict[int, int] = {}
    for b in builds:
        first.setdefault(b.pp, b.rank)
    stages = {0, 1, max(first)} & set(first)
    return sorted(first[s] for s in stages)


def rehearse(
    cfg: DapoConfig,
    nodes: int,
    gpus_per_node: int,
    recipe: str = "",
    progress=None,
    every_rank: bool = False,
    step: bool = False,
    jobs: int = 2,
    measured: dict | None = None,
) -> Rehearsal:
    """Build every rank of ``cfg``'s layout on ``nodes × gpus_per_node`` GPUs and check it (module docstring); with
    ``step``, one rank per pipeline stage also trains once on fake tensors (``rank_step.py``, ``jobs`` at a time);
    ``measured``: {rank: RankStep} of an earlier step to compare with instead (the docs' tables, ``bench/``)."""
    from megatron_dapo.launch.layout import layout_memory
    from megatron_dapo.launch.placement import PlacementError, make_placement

    t0 = time.monotonic()
    p, r = cfg.parallel, cfg.rollout
    arch = load_arch(cfg.model.arch)
    colocated = cfg.cluster.placement == "colocated"
    try:
        placement = make_placement(
            nodes,
            gpus_per_node,
            p.tp,
            p.pp,
            p.cp,
            engine_spec(r.engine).tp(cfg),
            colocated,
            cfg.cluster.rollout_nodes if not colocated else 0,
        )
    except PlacementError as e:
        raise ConfigError(str(e)) from e
    layout = layout_memory(cfg, nodes, gpus_per_node)
    failures = [f"memory model: {reason}" for reason in layout.reasons]
    builds = build_ranks(cfg, arch, placement.world, progress, every_rank)
    for b in builds:
        want = placement.coords(b.rank)
        if b.coords() != want:
            failures.append(f"rank {b.rank}: megatron-core places it at {b.coords()}, the launch assumes {want}")
        lora = cfg.model.lora
        adapters = lora_params(arch, lora.rank, p.tp, p.pp, b.pp, tuple(lora.targets)) if lora.rank else 0
        expected = count_params(arch, p.tp, p.pp, b.pp, ep=p.ep) + adapters
        if b.params != expected:
            failures.append(f"rank {b.rank} (PP stage {b.pp}): built {b.params:,} parameters, planner {expected:,}")
        if lora.rank and b.trainable_params != adapters:
            failures.append(f"rank {b.rank} (PP stage {b.pp}): {b.trainable_params:,} parameters train, the "
                            f"planner's LoRA adapters are {adapters:,}")  # fmt: skip
        if b.expert_params != (want_experts := expert_params(arch, p.tp, p.pp, b.pp, p.ep)):
            failures.append(f"rank {b.rank} (PP stage {b.pp}): built {b.expert_params:,} expert parameters, "
                            f"planner {want_experts:,}")  # fmt: skip
    sync = sync_plan(cfg, arch, placement)
    if sync.model_bytes != BF16 * total_params(arch) and cfg.model.dtype == "bf16":
        failures.append(f"sync: the HF model is {sync.model_bytes:,} B, the memory model {BF16 * total_params(arch):,}")
    classes: dict[tuple[int, str], RankClass] = {}
    for b in builds:
        key = (b.pp, _role(b.rank, placement))
        if key not in classes:
            classes[key] = RankClass(b.pp, key[1], [], b)
        cls = classes[key]
        if (b.params, b.gemm_params, b.expert_params) != (
            cls.build.params,
            cls.build.gemm_params,
            cls.build.expert_params,
        ):
            failures.append(
                f"rank {b.rank}: {b.params:,} parameters, rank {cls.ranks[0]} of its class {cls.build.params:,}"
            )
        cls.ranks.append(b.rank)
    steps = dict(measured or {})
    if step and not steps:
        from megatron_dapo.planning.rank_step import run_steps

        steps = run_steps(cfg, step_ranks(builds), placement.world, jobs, getattr(progress, "steps", None))
        failures += _step_failures(steps, builds, arch)
    by_stage = {next(b.pp for b in builds if b.rank == rank): st for rank, st in steps.items()}
    control = _walk_control_plane(cfg, placement.world, builds, failures)
    usable = layout.usable_gb * GiB
    for cls in sorted(classes.values(), key=lambda c: (c.stage, c.role)):
        cls.phases = _phases(cls, cfg, layout, sync, by_stage.get(cls.stage))
        for ph in cls.phases:
            if ph.rehearsed > usable:
                top = max(ph.terms, key=lambda t: t.rehearsed)
                failures.append(
                    f"{cls.label}: {ph.phase} phase needs {ph.rehearsed / GiB:.1f} GiB > {usable / GiB:.1f} "
                    f"GiB usable (largest term: {top.name} {top.rehearsed / GiB:.1f} GiB)"
                )
            for t in ph.terms:
                if t.disagrees():
                    how = "measured" if t.margin == STEP_MARGIN else "built"
                    failures.append(
                        f"{cls.label}: {ph.phase} phase, {t.name}: {how} {t.rehearsed / GiB:.3f} GiB, "
                        f"memory model {t.model / GiB:.3f} GiB (margin {t.margin:.0%})"
                    )
    return Rehearsal(
        recipe,
        nodes,
        gpus_per_node,
        placement.world,
        usable,
        sorted(classes.values(), key=lambda c: (c.stage, c.role)),
        sync,
        failures,
        time.monotonic() - t0,
        layout.label(),
        steps,
        control,
    )


def _walk_control_plane(cfg: DapoConfig, world: int, builds, failures: list[str]) -> dict:
    """Every schedule's step boundary walked at the recipe's rank count (``control_walk.walk_schedules``) for rank 0
    and the first rank of every later pipeline stage: {schedule: {rank: collectives}}; a rank that would enter the
    sync's default-group collectives before meeting rank 0 on the control plane is a failure."""
    from megatron_dapo.planning.control_walk import check_sync, describe, walk_schedules

    others = tuple(r for r in step_ranks(builds) if r != 0) or ((1,) if world > 1 else ())
    out = {}
    for name, walk in walk_schedules(cfg, world, ranks=others).items():
        failures += [f"control plane: {f}" for f in check_sync(walk, name)]
        out[name] = describe(walk)
    return out


def _control_lines(control: dict, step: int = 1) -> list[str]:
    """Step ``step``'s collectives per schedule and rank, in order, on one line each."""
    lines = [f"control plane, step {step} (each schedule; a rank's collectives in order, group: op (phase)):"]
    for name, ranks in control.items():
        for rank, events in ranks.items():
            mine = [e.replace(f" (step {step}: ", " (") for e in events if f"(step {step}:" in e]
            lines.append(f"  {name}, rank {rank}: " + " · ".join(_fold(mine)))
    return lines


def _fold(items: list[str], longest: int = 6) -> list[str]:
    """Runs of a repeated group written once: ``(a · b) x 16`` (streamed updates repeat theirs per mini-batch)."""
    out, i = [], 0
    while i < len(items):
        period, reps = 1, 1
        for k in range(1, longest + 1):
            n = 1
            while items[i + n * k : i + (n + 1) * k] == items[i : i + k]:
                n += 1
            if n > 1 and n * k > period * reps:
                period, reps = k, n
        group = " · ".join(items[i : i + period])
        out.append(group if reps == 1 else f"{group} x {reps}" if period == 1 else f"({group}) x {reps}")
        i += period * reps
    return out


def _step_failures(steps: dict, builds, arch) -> list[str]:
    """What a step found that the build did not: the bridge's table against the parameters megatron-core built (the
    export would wait for a tensor no stage sends, or never send one), and the step's parameters."""
    out = []
    for rank, st in steps.items():
        b = next(b for b in builds if b.rank == rank)
        if st.unmapped:
            out.append(f"rank {rank} (PP stage {b.pp}): {len(st.unmapped)} built parameters the bridge does not "
                       f"map, e.g. {st.unmapped[0]}")  # fmt: skip
        if st.unbuilt:
            out.append(f"rank {rank} (PP stage {b.pp}): the bridge maps {len(st.unbuilt)} parameters megatron-core "
                       f"did not build, e.g. {st.unbuilt[0]}")  # fmt: skip
        if st.params != b.params:
            out.append(f"rank {rank}: the step built {st.params:,} parameters, the meta build {b.params:,}")
    return out


def _ranks_text(ranks: list[int]) -> str:
    return f"{len(ranks)} ranks ({ranks[0]}, …, {ranks[-1]})" if len(ranks) > 3 else f"ranks {ranks}"


def render(result: Rehearsal) -> str:
    gib = GiB
    lines = [
        f"rehearsal of {result.recipe or 'the config'}: {result.world} trainer ranks on {result.nodes} nodes × "
        f"{result.gpus_per_node} GPUs, {result.layout_label}; built in {result.seconds:.0f} s"
    ]
    s = result.sync
    if s.adapter_tensors:
        lines.append(
            f"weight sync: the LoRA adapters only, {s.adapter_tensors} tensors, {s.adapter_bytes / gib:.2f} GiB "
            f"gathered on rank 0 (a PEFT folder, /load_lora_adapter) to {len(s.routes)} engines; the base never moves"
        )
    else:
        lines.append(
            f"weight sync: {s.export.tensors} HF tensors, {s.model_bytes / gib:.2f} GiB in {s.export.buckets} buckets "
            f"(largest {s.largest / 2**20:.0f} MiB) to {len(s.routes)} engines"
        )
    g = s.gather
    lines.append(f"{s.export.describe()}")
    if s.concurrency:
        lines.append(
            f"rollout: each of the {len(s.routes)} engines keeps up to {s.concurrency} requests in flight "
            "(rollout.max_concurrency, or less where a server reports a smaller max_running_requests)"
        )
    lines.append(
        f"old-logprob gather (every response at full length): 0 GiB on the GPUs; host {g.driver / gib:.2f} GiB "
        f"on rank 0, {g.share / gib:.2f} GiB on the others (all_gather_object on the default group held "
        f"{g.replaced_device / gib:.1f} GiB on every GPU)"
    )
    if result.steps:
        st = next(iter(result.steps.values()))
        lines.append(
            f"step: ranks {sorted(result.steps)} (for PP stages 0, 1 and the last) each trained once on fake tensors: "
            f"{st.micro_batches} micro-batches of {st.micro_batch_tokens:,} tokens through megatron-core's schedule, "
            f"the optimizer step, the logprob pass and the export; memory measured by torch's MemTracker "
            f"({max(s.seconds for s in result.steps.values()):.0f} s per rank)"
        )
    if result.control:
        lines += _control_lines(result.control)
    lines.append("")
    lines.append("| rank class | ranks | params per rank | " + " | ".join(PHASES) + " |")
    lines.append("|---|---|---:|" + "---:|" * len(PHASES))
    for cls in result.classes:
        by = {ph.phase: ph for ph in cls.phases}
        cells = [f"{by[ph].rehearsed / gib:.1f} / {by[ph].model / gib:.1f}" if ph in by else "-" for ph in PHASES]
        lines.append(f"| {cls.label} | {_ranks_text(cls.ranks)} | {cls.build.params:,} | " + " | ".join(cells) + " |")
    side = "built (the trainer's terms measured by the step)" if result.steps else "built"
    lines.append(
        f"\nGiB per GPU, {side} / memory model; usable {result.usable / gib:.1f} GiB. Terms of the heaviest phase "
        "of each class:"
    )
    for cls in result.classes:
        ph = max(cls.phases, key=lambda x: x.rehearsed)
        terms = ", ".join(f"{t.name} {t.rehearsed / gib:.2f}" for t in ph.terms if t.rehearsed)
        lines.append(f"  {cls.label}, {ph.phase}: {terms}")
    lines.append("")
    lines += [f"FAIL {f}" for f in result.failures] or ["OK: every rank built as placed and counted; every phase fits"]
    return "\n".join(lines)


def as_dict(result: Rehearsal) -> dict:
    return {
        "recipe": result.recipe,
        "nodes": result.nodes,
        "gpus_per_node": result.gpus_per_node,
        "world": result.world,
        "ok": result.ok,
        "failures": result.failures,
        "seconds": result.seconds,
        "steps": {rank: st.as_dict() for rank, st in result.steps.items()},
        "control": result.control,
        "sync": {
            "export": dataclasses.asdict(result.sync.export),
            "gather": dataclasses.asdict(result.sync.gather),
            "routes": result.sync.routes,
            "concurrency_per_server": result.sync.concurrency,
            "adapter_tensors": result.sync.adapter_tensors,  # LoRA adapter-only sync (0: the whole model)
            "adapter_bytes": result.sync.adapter_bytes,
        },
        "classes": [
            {
                "stage": c.stage,
                "role": c.role,
                "ranks": c.ranks,
                "params": c.build.params,
                "param_bytes": c.build.param_bytes,
                "trainable_params": c.build.trainable_params,
                "phases": {
                    ph.phase: {
                        "rehearsed": ph.rehearsed,
                        "model": ph.model,
                        "terms": {t.name: [t.rehearsed, t.model] for t in ph.terms},
                    }
                    for ph in c.phases
                },
            }
            for c in result.classes
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dapo rehearse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True, help="a GPU recipe (dapo_32b, dapo_qwen3_32b, dapo_7b) or YAML path")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, as `dapo launch` takes them")
    ap.add_argument("--nodes", type=int, help="default: cluster.nodes")
    ap.add_argument("--gpus-per-node", type=int, help="default: cluster.gpus_per_node")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument(
        "--no-step",
        action="store_true",
        help="build and count only: no rank trains on fake tensors (seconds instead of minutes; memory from the model)",
    )
    ap.add_argument("--jobs", type=int, default=2, help="rank steps run at once, one process each (default 2)")
    ap.add_argument(
        "--every-rank",
        action="store_true",
        help="build every rank's model (default: one per TP/CP/PP position, reused for its data-parallel replicas)",
    )
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
        nodes = args.nodes or cfg.cluster.nodes
        gpus = args.gpus_per_node or cfg.cluster.gpus_per_node
        bar = None if args.json else _progress_bar()
        result = rehearse(cfg, nodes, gpus, args.recipe, bar, args.every_rank, not args.no_step, args.jobs)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(as_dict(result), indent=1) if args.json else render(result))
    return 0 if result.ok else 1


def _progress_bar():
    def show(done: int, total: int) -> None:
        width = 40
        filled = width * done // total
        end = "\n" if done == total else ""
        print(
            f"\rbuilding ranks [{'#' * filled}{'.' * (width - filled)}] {done}/{total}",
            end=end,
            file=sys.stderr,
            flush=True,
        )

    def steps(done: int, total: int) -> None:
        print(f"rank steps on fake tensors: {done}/{total} done", file=sys.stderr, flush=True)

    show.steps = steps
    return show
