"""Memory / parallelism planner: model × sequence length × cluster → the TP/PP/CP/micro-batch plan that fits.

    plans = plan("qwen2.5-32b", max_prompt=2048, max_response=20480, nodes=16, gpus_per_node=8, gpu_mem_gb=80)
    best = choose(plans)          # raises NoFeasiblePlan with the reason when nothing fits
    print(best.explain())

Every candidate (TP, PP, CP, DP, micro-batch tokens, recompute, distributed optimizer, FP8) gets a per-GPU memory
prediction (bytes, reported in GiB) for the worst pipeline stage, and a rough step time. Formulas (all per GPU):

- Parameters: ``count_params`` is exact for our megatron-core GPTModel (see its docstring).
- Weights 2 B/param (bf16). FP8 adds 2 B per GEMM weight of the layers (TE's FP8 copy and its transpose).
- Gradients 4 B/param (megatron DDP's fp32 main-grad buffer; not sharded by the distributed optimizer).
- Optimizer 12 B/param (fp32 master copy + Adam's two moments), ÷ (DP·CP) with the distributed optimizer
  (it shards over the data-parallel-with-context-parallel group).
- Activations: ``activation_bytes_per_token`` per layer and token (Korthikanti et al. 2022, generalized to GQA and
  SwiGLU; it reduces to their 34·h + 5·a·s for GPT), × tokens per GPU (micro-batch tokens ÷ CP; everything ÷ TP since
  we run sequence parallelism whenever TP > 1), × layers per stage, × micro-batches in flight: 1F1B keeps
  min(PP − stage, micro-batches) of them on a stage, so stage 0 holds the most. Full recompute keeps only each
  layer's input (2·h B/token) for the in-flight micro-batches, plus one layer's full activations while recomputing.
- Logits (last stage): ``chunk`` tokens × padded_vocab/TP × 10 B (bf16 logits + fp32 log-softmax + fp32 grad), plus
  the final hidden states gathered from sequence parallelism and their response-position copy (2 × tokens × h × 2 B).
  This is how the actor works (output GEMM + log-softmax chunk by chunk, ``parallel.logprob_chunk_tokens``); pass
  ``logprob_chunk_tokens=0`` to size the logits for a whole micro-batch instead.
- Colocated, three phases (``Plan.phases``, each must fit): *train* = the trainer's peak while SGLang has released
  its weights and KV cache and keeps ``rollout_residual_gb`` (or, with ``rollout_release=False``, its whole
  ``mem_fraction``); *rollout* = the trainer's weights (its grads and optimizer states on the host:
  ``offload_train_state``, what ``placement.to_rollout()`` does; without it they stay) + overhead + SGLang's
  ``mem_fraction`` of the GPU (or, when None, what the trainer leaves), which must hold its weight shard plus a KV
  cache for ``min_rollout_seqs`` full-length sequences per engine, + its CUDA graphs (``cuda_graph_gb``, outside
  ``mem_fraction``); *startup* = before the engines first release: the trainer's weights, grads and optimizer states
  (a resumed run has loaded them) + the engines' whole ``mem_fraction`` and CUDA graphs.
- Framework overhead: ``overhead_gb`` (CUDA context, NCCL buffers, allocator fragmentation, TE workspaces).
- Step time: FLOPs = tokens · (8·N + recompute extra) + attention, over GPUs × peak × MFU × TP/CP efficiency,
  stretched by the pipeline bubble, plus the gradient reduction of every optimizer update (see ``_step_time``).

Ranking: feasible plans by estimated step time; within 1% prefer fewer model-parallel GPUs (TP·PP·CP), then smaller
PP, smaller TP, the distributed optimizer, less recompute.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import ArchConfig, load_arch, padded_vocab_size
from megatron_dapo.models.memory import (  # noqa: F401 - the formulas, re-exported for plan users
    BF16,
    FP32,
    RECOMPUTE,
    SELECTIVE_MODULES,
    GiB,
    PhaseMemory,
    _check_split,
    activation_bytes_per_token,
    count_params,
    layer_gemm_params,
    layer_params,
    rollout_phase,
    startup_phase,
    total_params,
    train_phase,
)


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

    @property
    def total(self) -> float:
        return self.resident + self.activations + self.logits + self.rollout + self.overhead

    @property
    def resident(self) -> float:
        """What the trainer keeps between steps: weights, grads, optimizer states."""
        return self.weights + self.fp8_cache + self.grads + self.optimizer


@dataclass
class Rollout:
    """The SGLang side: its TP, memory share per GPU and KV-cache capacity per engine (tokens)."""

    colocated: bool
    sglang_tp: int
    share: float  # bytes per GPU SGLang may use
    mem_fraction: float
    weights: float  # bytes per GPU
    kv_tokens: int  # per engine
    trainer_resident: float  # bytes the trainer keeps on the GPU during rollout


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

    @property
    def memory_gib(self) -> float:
        return self.memory.total / GiB

    def label(self) -> str:
        return (
            f"TP{self.tp} PP{self.pp} CP{self.cp} DP{self.dp} mb={self.micro_batch_tokens} "
            f"recompute={self.recompute} distopt={'on' if self.distributed_optimizer else 'off'} "
            f"fp8={'on' if self.fp8 else 'off'}"
        )

    def overrides(self) -> list[str]:
        """Dotted config overrides (``load_config(..., overrides=...)``) that apply this plan."""
        out = [
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.cp={self.cp}",
            f"parallel.sequence_parallel={'true' if self.tp > 1 else 'false'}",
            f"parallel.distributed_optimizer={'true' if self.distributed_optimizer else 'false'}",
            f"parallel.max_tokens_per_micro_batch={self.micro_batch_tokens}",
            f"model.recompute={'null' if self.recompute == 'none' else self.recompute}",
            f"model.fp8={'e4m3' if self.fp8 else 'null'}",
        ]
        if self.rollout is not None:
            out += [
                f"rollout.sglang_tp={self.rollout.sglang_tp}",
                f"rollout.mem_fraction={self.rollout.mem_fraction:.2f}",
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
            ("optimizer", m.optimizer, f"params × 12 B / {opt_div} (fp32 master + 2 Adam moments)"),
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
                f"rollout ({where}): SGLang TP{r.sglang_tp}, share {r.share / gib:.1f} GiB/GPU "
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


def _powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(int(math.log2(max(limit, 1))) + 1)]


@dataclass(frozen=True)
class PlanOptions:
    """The knobs of ``plan`` (keyword arguments) besides the model and the cluster."""

    colocated: bool = True  # SGLang and training share the GPUs; else SGLang runs on ``rollout_nodes``
    rollout_nodes: int | None = None  # disaggregated only; default half the nodes
    rollout_mem_fraction: float | None = None  # SGLang's share; None: colocated = what the trainer leaves, else 0.85
    rollout_release: bool = True  # colocated SGLang releases weights + KV cache while the actor trains
    rollout_residual_gb: float = 2.0  # what a released SGLang still holds (CUDA context, allocator, what it keeps)
    cuda_graph_gb: float = 2.0  # SGLang's captured CUDA graphs, outside its mem_fraction (held while not released)
    offload_train_state: bool = True  # colocated: grads + optimizer states on the host during rollout (weights stay)
    min_rollout_seqs: int = 16  # full-length sequences an SGLang engine's KV cache must hold
    batch_prompts: int = 512  # B
    group_size: int = 16  # G
    mini_batch_prompts: int = 32  # prompts per optimizer update
    mean_seq_len: float | None = None  # prompt + response, for the time estimate; default a quarter of the maximum
    logprob_chunk_tokens: int = 1024  # 0 = the actor materializes the logits of a whole micro-batch
    overhead_gb: float = 5.0
    usable_fraction: float = 0.95  # a plan must fit in this fraction of the GPU
    fp8_options: tuple[bool, ...] = (False, True)
    flash: bool = True  # fused / flash attention (always with TE; CP needs it)
    peak_tflops: float = 989.0  # dense bf16 per GPU (H100 SXM)
    mfu: float = 0.40
    fp8_speedup: float = 1.3
    dp_bandwidth_gbs: float = 40.0  # per GPU for the gradient collectives across nodes (×8 inside one node)
    micro_batch_multiples: tuple[int, ...] = (1, 2, 4)  # micro-batch token budgets, × the max sequence length


@dataclass(frozen=True)
class _Job:
    """What the candidates are evaluated against: the options plus quantities derived once."""

    arch: ArchConfig
    opt: PlanOptions
    max_seq: int
    world: int  # training GPUs
    gpus_per_node: int
    gpu: float  # bytes per GPU
    usable: float
    mean_seq: float
    step_tokens: float  # tokens of one training step
    updates: int  # optimizer updates per step
    dp_bandwidth_gbs: float


def _rollout(
    job: _Job, share: float, trainer_resident: float, fixed_tp: int | None = None
) -> tuple[Rollout, str | None]:
    """Pick (or, with ``fixed_tp``, check) the smallest SGLang TP whose weight shard uses ≤ half the share and whose KV cache holds
    ``min_rollout_seqs`` full-length sequences. KV bytes/token = 2 (K, V) · layers · kv_heads · head_dim · 2 B,
    divided by min(TP, kv_heads) per GPU (KV heads are replicated beyond that)."""
    a = job.arch
    weights_total = BF16 * total_params(a)
    kv_per_token = 2 * a.num_layers * a.num_query_groups * a.head_dim * BF16
    best = None
    for tp in [fixed_tp] if fixed_tp else _powers_of_two(job.gpus_per_node):
        weights = weights_total / tp
        kv_tokens = int(max(share - weights, 0) / (kv_per_token / min(tp, a.num_query_groups)))
        best = Rollout(job.opt.colocated, tp, share, share / job.gpu, weights, kv_tokens, trainer_resident)
        if weights <= share / 2 and kv_tokens >= job.opt.min_rollout_seqs * job.max_seq:
            return best, None
    assert best is not None
    return best, (
        f"SGLang does not fit: {share / GiB:.1f} GiB/GPU left for rollout; at TP{best.sglang_tp} its weights take "
        f"{best.weights / GiB:.1f} GiB and the KV cache holds {best.kv_tokens:,} tokens, fewer than "
        f"{job.opt.min_rollout_seqs} × {job.max_seq} (min_rollout_seqs × max sequence)"
    )


def _make_job(model, max_prompt, max_response, nodes, gpus_per_node, gpu_mem_gb, options) -> _Job:
    arch = load_arch(model) if isinstance(model, str) else model
    try:
        opt = PlanOptions(**options)
    except TypeError as e:
        known = ", ".join(f.name for f in dataclasses.fields(PlanOptions))
        raise ConfigError(f"plan: {e}; known options: {known}") from e
    for key, value in (("max_prompt", max_prompt), ("max_response", max_response), ("nodes", nodes)):
        if value < 1:
            raise ConfigError(f"plan: {key} = {value}: must be >= 1")
    if gpus_per_node < 1 or gpu_mem_gb <= 0:
        raise ConfigError(f"plan: gpus_per_node = {gpus_per_node}, gpu_mem_gb = {gpu_mem_gb}: must be > 0")
    if opt.rollout_mem_fraction is not None and not 0 < opt.rollout_mem_fraction < 1:
        raise ConfigError(f"plan: rollout_mem_fraction = {opt.rollout_mem_fraction}: must be in (0, 1)")
    if opt.mini_batch_prompts < 1 or opt.batch_prompts % opt.mini_batch_prompts:
        raise ConfigError(f"plan: mini_batch_prompts = {opt.mini_batch_prompts}: must divide batch_prompts")
    train_nodes = nodes
    if not opt.colocated:
        rollout_nodes = nodes // 2 if opt.rollout_nodes is None else opt.rollout_nodes
        if not 0 < rollout_nodes < nodes:
            raise ConfigError(f"plan: rollout_nodes = {rollout_nodes}: disaggregated needs 0 < rollout_nodes < {nodes}")
        train_nodes = nodes - rollout_nodes
    max_seq = max_prompt + max_response
    mean_seq = opt.mean_seq_len if opt.mean_seq_len is not None else max_seq / 4
    world = train_nodes * gpus_per_node
    job = _Job(
        arch=arch,
        opt=opt,
        max_seq=max_seq,
        world=world,
        gpus_per_node=gpus_per_node,
        gpu=gpu_mem_gb * GiB,
        usable=opt.usable_fraction * gpu_mem_gb * GiB,
        mean_seq=mean_seq,
        step_tokens=opt.batch_prompts * opt.group_size * mean_seq,
        updates=opt.batch_prompts // opt.mini_batch_prompts,
        # the gradient collectives cross nodes as soon as the job does
        dp_bandwidth_gbs=opt.dp_bandwidth_gbs * (1 if world > gpus_per_node else 8),
    )
    return job


def plan(
    model: str | ArchConfig,
    max_prompt: int,
    max_response: int,
    nodes: int,
    gpus_per_node: int,
    gpu_mem_gb: float,
    **options,
) -> list[Plan]:
    """Evaluate every plan; return them all, feasible ones first (best first), then the rest (closest first).

    ``gpu_mem_gb`` is in GiB; a plan must fit in ``usable_fraction`` of it (overhead included). ``options`` are the
    fields of ``PlanOptions`` (``colocated=False``, ``rollout_nodes=4``, …). Colocated: training and SGLang share all
    ``nodes × gpus_per_node`` GPUs, SGLang releasing its memory while the actor trains (``rollout_release``; else it
    keeps ``rollout_mem_fraction``, default 0.6). Disaggregated: SGLang on ``rollout_nodes``, training on the rest.
    TP stays within a node; the layers must split evenly over PP.
    """
    job = _make_job(model, max_prompt, max_response, nodes, gpus_per_node, gpu_mem_gb, options)
    arch, opt, world, max_seq = job.arch, job.opt, job.world, job.max_seq
    plans = []
    for tp in _powers_of_two(gpus_per_node):
        try:
            _check_split(arch, tp, 1)
        except ValueError:
            continue
        for pp in (p for p in range(1, arch.num_layers + 1) if arch.num_layers % p == 0 and tp * p <= world):
            for cp in (c for c in _powers_of_two(world // (tp * pp)) if world % (tp * pp * c) == 0):
                for mult, recompute, distopt, fp8 in itertools.product(
                    opt.micro_batch_multiples, RECOMPUTE, (True, False), opt.fp8_options
                ):
                    mb_tokens = -(-max_seq * mult // (256 * cp)) * 256 * cp  # whole sequences; THD+CP: 2·CP | length
                    plans.append(_evaluate(job, tp, pp, cp, mb_tokens, recompute, distopt, fp8))
    return rank_plans(plans)


def evaluate_layout(
    model: str | ArchConfig,
    max_prompt: int,
    max_response: int,
    nodes: int,
    gpus_per_node: int,
    gpu_mem_gb: float,
    *,
    tp: int,
    pp: int,
    cp: int,
    micro_batch_tokens: int,
    recompute: str = "none",
    distributed_optimizer: bool = True,
    fp8: bool = False,
    sglang_tp: int | None = None,
    **options,
) -> Plan:
    """The one plan of a chosen layout (a recipe's): its memory per phase and step time; ``feasible`` says whether it
    fits, ``reasons`` why not. ``options`` as for ``plan``."""
    job = _make_job(model, max_prompt, max_response, nodes, gpus_per_node, gpu_mem_gb, options)
    if job.world % (tp * pp * cp):
        raise ConfigError(f"parallel.tp × pp × cp = {tp}×{pp}×{cp}: must divide the {job.world} training GPUs")
    try:
        _check_split(job.arch, tp, pp)
    except ValueError as e:
        raise ConfigError(f"parallel: {e}") from e
    return _evaluate(job, tp, pp, cp, micro_batch_tokens, recompute, distributed_optimizer, fp8, sglang_tp, True)


def _evaluate(
    job: _Job,
    tp: int,
    pp: int,
    cp: int,
    mb_tokens: int,
    recompute: str,
    distopt: bool,
    fp8: bool,
    sglang_tp: int | None = None,
    every_stage: bool = False,
) -> Plan:
    """Memory of the first and last stage (the others hold fewer parameters than the first and fewer in-flight
    activations than stage 0; ``every_stage``: all of them), the rollout phase, and the step time of one candidate."""
    arch, o, L, h = job.arch, job.opt, job.arch.num_layers, job.arch.hidden_size
    overhead = o.overhead_gb * GiB
    dp = job.world // (tp * pp * cp)
    vocab = padded_vocab_size(arch.vocab_size, tp)
    tok_gpu = mb_tokens // cp
    m_update = max(math.ceil(job.step_tokens / job.updates / dp / (mb_tokens * 0.97)), 1)  # ~3% packing loss
    per_layer = activation_bytes_per_token(arch, recompute, flash=o.flash, attn_seq_len=mb_tokens) * tok_gpu / tp
    working = 0.0
    if recompute == "full":  # one layer's activations while it is recomputed
        working = activation_bytes_per_token(arch, "none", flash=o.flash, attn_seq_len=mb_tokens) * tok_gpu / tp
    chunk = min(o.logprob_chunk_tokens, tok_gpu) if o.logprob_chunk_tokens > 0 else tok_gpu
    if not o.colocated:
        rollout_held = 0.0
    elif o.rollout_release:
        rollout_held = o.rollout_residual_gb * GiB
    else:
        rollout_held = (o.rollout_mem_fraction or 0.6) * job.gpu
    stages = []
    for s in range(pp) if every_stage else sorted({0, pp - 1}):
        p = count_params(arch, tp, pp, s, vocab)
        last = s == pp - 1
        stages.append(
            Memory(
                stage=s,
                params=p,
                weights=BF16 * p,
                fp8_cache=2.0 * L // pp * layer_gemm_params(arch, tp) if fp8 else 0.0,
                grads=FP32 * p,
                optimizer=12.0 * p / (dp * cp if distopt else 1),
                activations=min(pp - s, m_update) * (L // pp) * per_layer + working,
                logits=chunk * vocab / tp * 10.0 + 2 * tok_gpu * h * BF16 if last else 0.0,
                rollout=rollout_held,
                overhead=overhead,
            )
        )
    worst = max(stages, key=lambda x: x.total)
    reasons = []
    if worst.total > job.usable:
        reasons.append(_overflow(worst, job.usable))
    kept = max(stages, key=lambda st: st.weights + st.fp8_cache if o.offload_train_state else st.resident)
    resident = (kept.weights + kept.fp8_cache if o.offload_train_state else kept.resident) if o.colocated else 0.0
    if o.colocated:
        # unset: what the trainer leaves at start-up, when its whole resident state is on the GPU beside the engine
        startup_resident = max(st.resident for st in stages)
        graphs = o.cuda_graph_gb * GiB
        share = (
            o.rollout_mem_fraction * job.gpu
            if o.rollout_mem_fraction is not None
            else job.usable - max(resident, startup_resident) - overhead - graphs
        )
    else:
        share = (o.rollout_mem_fraction or 0.85) * job.gpu
    rollout, why = _rollout(job, max(share, 0.0), resident, sglang_tp)
    phases = []
    if o.colocated:
        opt_div = dp * cp if distopt else 1
        phases = [
            train_phase(worst, job.usable, opt_div),
            rollout_phase(kept, rollout, o, job.usable),
            startup_phase(max(stages, key=lambda st: st.resident), rollout, o, job.usable, opt_div),
        ]
        if not phases[2].fits:
            reasons.append(
                f"start-up phase: the trainer's weights, grads and optimizer states + SGLang's mem_fraction "
                f"{rollout.mem_fraction:.2f} and CUDA graphs = {phases[2].total / GiB:.1f} > {job.usable / GiB:.1f} GiB "
                "usable before the engines first release their memory (lower rollout.mem_fraction)"
            )
        if not phases[1].fits:
            reasons.append(
                f"rollout phase: trainer keeps {resident / GiB:.1f} GiB + overhead {o.overhead_gb:g} + SGLang "
                f"{share / GiB:.1f} GiB = {phases[1].total / GiB:.1f} > {job.usable / GiB:.1f} GiB usable (lower the "
                "SGLang mem_fraction or offload the train state)"
            )
    if why:
        reasons.append(why)
    if (seqs := o.mini_batch_prompts * o.group_size) < dp:
        reasons.append(f"a mini-batch has {seqs} sequences, fewer than DP = {dp} ranks")
    flops, time_s, bubble = _step_time(
        job, vocab, tp, pp, cp, dp, m_update, recompute, fp8, max(st.params for st in stages)
    )
    return Plan(
        tp=tp,
        pp=pp,
        cp=cp,
        dp=dp,
        micro_batch_tokens=mb_tokens,
        recompute=recompute,
        distributed_optimizer=distopt,
        fp8=fp8,
        gpu_mem_gb=job.gpu / GiB,
        usable_gb=job.usable / GiB,
        train_gpus=job.world,
        memory=worst,
        stage_totals={st.stage: st.total for st in stages},
        rollout=rollout,
        micro_batches_per_update=m_update,
        pipeline_bubble=bubble,
        step_time_s=time_s,
        flops_per_step=flops,
        feasible=not reasons,
        reasons=reasons,
        model=arch.name,
        max_seq_len=job.max_seq,
        phases=phases,
        stages=stages,
        options=o,
    )


def _overflow(m: Memory, usable: float) -> str:
    parts = {
        "weights": m.weights + m.fp8_cache,
        "grads": m.grads,
        "optimizer": m.optimizer,
        "activations": m.activations,
        "logits": m.logits,
        "rollout": m.rollout,
        "overhead": m.overhead,
    }
    biggest = ", ".join(f"{k} {v / GiB:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:3])
    return f"training needs {m.total / GiB:.1f} GiB per GPU on stage {m.stage} > {usable / GiB:.1f} GiB usable ({biggest} GiB)"


def _step_time(
    job: _Job,
    vocab: int,
    tp: int,
    pp: int,
    cp: int,
    dp: int,
    m_update: int,
    recompute: str,
    fp8: bool,
    params: int,
) -> tuple[float, float, float]:
    """Rough training time of one step (old-logprob pass + all updates), in seconds; returns (FLOPs, s, bubble).

    Dense FLOPs per token: 2·N forward (N = layer GEMM weights + output layer) → old logprobs 2N + train 6N = 8N;
    recompute adds a forward of what it recomputes (full: 2N; selective: the MLP, 2·3hf per layer). Causal attention:
    2·q·s per layer and token forward (s ≈ mean sequence length), ×4 for the two passes (+1 with full recompute).
    Compute time = FLOPs / (GPUs × peak × MFU × 0.96^log2(TP) × 0.95^log2(CP)) ÷ FP8 speedup, divided by the 1F1B
    efficiency m/(m + PP − 1) (m = micro-batches per update per DP rank). Each update adds a reduce-scatter +
    all-gather of the fp32 grads, not hidden: 2 × 4 B × params/GPU × (n−1)/n over ``dp_bandwidth_gbs`` (n = DP·CP).
    """
    a = job.arch
    q = a.num_attention_heads * a.head_dim
    n_dense = a.num_layers * layer_gemm_params(a) + vocab * a.hidden_size
    attn_fwd = 2 * q * job.mean_seq * a.num_layers
    per_token = 8 * n_dense + 4 * attn_fwd
    if recompute == "full":
        per_token += 2 * n_dense + attn_fwd
    elif recompute == "selective":
        per_token += 2 * 3 * a.hidden_size * a.ffn_hidden_size * a.num_layers
    flops = per_token * job.step_tokens
    eff = job.opt.mfu * 0.96 ** math.log2(tp) * 0.95 ** math.log2(cp)
    compute = flops / (job.world * job.opt.peak_tflops * 1e12 * eff) / (job.opt.fp8_speedup if fp8 else 1.0)
    bubble = (pp - 1) / (m_update + pp - 1)
    n = dp * cp
    comm = job.updates * 2 * FP32 * params * (n - 1) / n / (job.dp_bandwidth_gbs * 1e9) if n > 1 else 0.0
    return flops, compute / (1 - bubble) + comm, bubble


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
