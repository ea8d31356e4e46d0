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
- Logits (last stage): ``chunk`` tokens × padded_vocab/TP × 6 B (``logits_bytes``: fp32 logits and their gradient,
  the chunk recomputed in backward), plus the final hidden states gathered from sequence parallelism and their
  response-position copy (2 × tokens × h × 2 B). The old-logprob pass: ``forward_pass_bytes``. A layer's backward
  holds its gradients and SP's gather buffer beyond the saved activations (``backward_working_bytes``). Each term
  is checked against torch's accounting of a real step on fake tensors by ``dapo rehearse`` (within 10%).
  A mixture of experts: an MoE layer keeps the router's tensors and, per routed copy, the experts' input and
  intermediates (``moe_layer_activation_delta``); the running one peaks at its combine (``moe_working_bytes``: the
  experts' outputs, their fp32 copy for the reduce-scatter), with its whole activations when recomputed, and under full
  recompute the stage's other MoE layers keep their last backward's input gradient (``moe_retained_bytes``); the
  forward-only pass: ``moe_forward_bytes``. On the last stage the head's logits and an MoE layer's peak come one after
  the other in the backward: the larger counts, not their sum. ``moe_imbalance`` applies with EP > 1 only (EP = 1: every rank runs
  exactly k copies of each token of its TP group).
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
from dataclasses import dataclass

from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.engines.registry import engine_spec
from megatron_dapo.models.arch import ArchConfig, load_arch, padded_vocab_size
from megatron_dapo.models.gpus import gpu_total_gib
from megatron_dapo.models.memory import (
    BF16,
    FP32,
    RECOMPUTE,
    GiB,
    _check_split,
    activation_bytes_per_token,
    active_gemm_params,
    backward_working_bytes,
    count_params,
    expert_params,
    forward_pass_bytes,
    logits_bytes,
    lora_params,
    moe_forward_bytes,
    moe_layer_activation_delta,
    moe_retained_bytes,
    moe_working_bytes,
    rollout_phase,
    rope_table_bytes_per_token,
    stage_gemm_params,
    startup_phase,
    train_phase,
)
from megatron_dapo.planning.plans import Memory, Plan, PlanOptions, Rollout, rank_plans


def _powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(int(math.log2(max(limit, 1))) + 1)]


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
    job: _Job,
    mem_fraction: float | None,
    trainer_resident: float,
    fixed_tp: int | None = None,
    rooms: tuple[float, float] | None = None,
) -> tuple[Rollout, str | None]:
    """Pick (or, with ``fixed_tp``, check) the smallest SGLang TP whose weight shard uses ≤ ``rollout_weight_share`` of
    its share and whose KV cache holds ``min_rollout_seqs`` full-length sequences. SGLang's bytes are its own terms
    (``engines/sglang/memory.py``: weights, KV = mem_fraction × free memory at start − weights, request table, CUDA
    graphs, runtime, activations); ``mem_fraction`` None: the largest that fits ``rooms`` (the bytes the start-up and
    the rollout phase leave the engine)."""
    a, engine = job.arch, engine_spec(job.opt.engine)
    best = None
    for tp in [fixed_tp] if fixed_tp else _powers_of_two(job.gpus_per_node):
        mf = mem_fraction if mem_fraction is not None else engine.fit_mem_fraction(a, tp, job.gpu, *rooms)
        sg = engine.memory(a, tp, job.gpu, mf)
        share = max(sg.weights + sg.kv_cache, 0.0)
        best = Rollout(job.opt.colocated, tp, share, mf, sg.weights, sg.kv_tokens, trainer_resident, sg, engine.tp_key)
        if (
            sg.weights <= share * job.opt.rollout_weight_share
            and sg.kv_tokens >= job.opt.min_rollout_seqs * job.max_seq
        ):
            return best, None
    assert best is not None
    return best, (
        f"the rollout engine ({job.opt.engine}) does not fit: mem_fraction {best.mem_fraction:.2f} leaves it {best.share / GiB:.1f} GiB/GPU; at "
        f"TP{best.engine_tp} its weights take {best.weights / GiB:.1f} GiB and the KV cache holds {best.kv_tokens:,} "
        f"tokens, fewer than {job.opt.min_rollout_seqs} × {job.max_seq} (min_rollout_seqs × max sequence)"
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
        gpu=gpu_total_gib(gpu_mem_gb) * GiB,  # an "80 GB" H100 has 79.65 GiB
        usable=opt.usable_fraction * gpu_total_gib(gpu_mem_gb) * GiB,
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
            cps = [c for c in _powers_of_two(world // (tp * pp)) if world % (tp * pp * c) == 0]
            for cp in [c for c in cps if c == 1 or not (arch.is_moe and opt.routing_replay)]:  # replay: CP 1 only
                dp = world // (tp * pp * cp)
                # megatron-core folds EP over DP x CP (expert TP = TP: the expert-data-parallel size is DP·CP/EP)
                eps = [e for e in _powers_of_two(dp * cp) if arch.num_experts % e == 0] if arch.is_moe else [1]
                for ep, mult, recompute, distopt, fp8 in itertools.product(
                    eps, opt.micro_batch_multiples, RECOMPUTE, (True, False), opt.fp8_options
                ):
                    mb_tokens = -(-max_seq * mult // (256 * cp)) * 256 * cp  # whole sequences; THD+CP: 2·CP | length
                    plans.append(_evaluate(job, tp, pp, cp, mb_tokens, recompute, distopt, fp8, ep=ep))
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
    engine_tp: int | None = None,
    ep: int = 1,
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
    dp = job.world // (tp * pp * cp)
    if ep > 1 and ((dp * cp) % ep or job.arch.num_experts % ep):
        raise ConfigError(
            f"parallel.ep = {ep}: must divide DP × CP = {dp * cp} (megatron-core folds EP over the data- and "
            f"context-parallel ranks) and num_experts = {job.arch.num_experts}"
        )
    return _evaluate(job, tp, pp, cp, micro_batch_tokens, recompute, distributed_optimizer, fp8, engine_tp, True, ep=ep)


def _evaluate(
    job: _Job,
    tp: int,
    pp: int,
    cp: int,
    mb_tokens: int,
    recompute: str,
    distopt: bool,
    fp8: bool,
    engine_tp: int | None = None,
    every_stage: bool = False,
    ep: int = 1,
) -> Plan:
    """Memory of the first and last stage (the others hold fewer parameters than the first and fewer in-flight
    activations than stage 0; ``every_stage``: all of them), the rollout phase, and the step time of one candidate."""
    arch, o, L, h = job.arch, job.opt, job.arch.num_layers, job.arch.hidden_size
    overhead = o.overhead_gb * GiB
    dp = job.world // (tp * pp * cp)
    vocab = padded_vocab_size(arch.vocab_size, tp)
    tok_gpu = mb_tokens // cp
    m_update = max(math.ceil(job.step_tokens / job.updates / dp / (mb_tokens * 0.97)), 1)  # ~3% packing loss
    rope = rope_table_bytes_per_token(arch) if recompute != "full" else 0.0  # not split by TP
    per_layer = (
        activation_bytes_per_token(arch, recompute, flash=o.flash, attn_seq_len=mb_tokens, tp=tp) / tp + rope
    ) * tok_gpu
    imb = o.moe_imbalance
    per_moe_layer = per_layer + moe_layer_activation_delta(arch, recompute, tp, imb, ep) * tok_gpu
    one_layer = (
        activation_bytes_per_token(arch, "none", flash=o.flash, attn_seq_len=mb_tokens, tp=tp) / tp
        + rope_table_bytes_per_token(arch)
    ) * tok_gpu
    working = backward_working_bytes(arch, tok_gpu, tp)  # a dense layer's backward: its gradients, SP's gather buffer
    if recompute == "full":  # one layer's activations while it is recomputed
        working += one_layer
    # an MoE layer's peak is at its combine (the experts' outputs, their fp32 copy for the reduce-scatter); recomputed,
    # with the layer's own activations (its experts' input and intermediates, the router's)
    sp_buffer = 2.0 * h * tok_gpu if tp > 1 else 0.0  # sequence parallelism's all-gather buffer, kept between layers
    moe_working = moe_working_bytes(arch, tok_gpu, tp, imb, ep) if arch.is_moe else 0.0
    moe_forward = moe_forward_bytes(arch, tok_gpu, tp, imb, ep) if arch.is_moe else 0.0
    if recompute == "full" and arch.is_moe:
        moe_working += one_layer + moe_layer_activation_delta(arch, "none", tp, imb, ep) * tok_gpu
    chunk = min(o.logprob_chunk_tokens, tok_gpu) if o.logprob_chunk_tokens > 0 else tok_gpu
    if not o.colocated:
        rollout_held = 0.0
    elif o.rollout_release:
        rollout_held = o.rollout_residual_gb * GiB
    else:
        rollout_held = (o.rollout_mem_fraction or 0.6) * job.gpu
    stages = []
    for s in range(pp) if every_stage else sorted({0, pp - 1}):
        p = count_params(arch, tp, pp, s, vocab, ep)
        experts = expert_params(arch, tp, pp, s, ep)
        lora = lora_params(arch, o.lora_rank, tp, pp, s, o.lora_targets)
        # what is trained: the adapters alone with LoRA (the base frozen: no grads, no optimizer state), else all
        trained, trained_experts = (lora, 0) if o.lora_rank else (p, experts)
        moe_layers = sum(arch.is_moe_layer(i) for i in range(s * L // pp, (s + 1) * L // pp))
        dense_layers = L // pp - moe_layers
        stage_layers = dense_layers * per_layer + moe_layers * per_moe_layer
        full = recompute == "full"
        # the running layer's peak: a dense layer's backward, or an MoE layer's combine with what the stage's other MoE
        # layers keep from their last backward under full recompute (moe_retained_bytes)
        stage_working = max(
            working if dense_layers else 0.0,
            moe_working + (moe_retained_bytes(arch, tok_gpu, tp, moe_layers) if full else 0.0) if moe_layers else 0.0,
        )
        forward_layer = max(
            one_layer if dense_layers else 0.0,
            moe_forward + (moe_retained_bytes(arch, tok_gpu, tp, moe_layers, True) if full else 0.0)
            if moe_layers
            else 0.0,
        )
        last = s == pp - 1
        logits = logits_bytes(chunk, vocab // tp, tok_gpu, h) if last else 0.0
        if last and moe_layers:
            # the head's backward (its logits) runs before the layers' and is over when an MoE layer peaks: the stage
            # peaks at the larger of the two, with a dense layer's working set (SP's buffer) beside the head
            stage_working = max(stage_working - logits, working if dense_layers else sp_buffer)
        stages.append(
            Memory(
                stage=s,
                params=p,
                weights=BF16 * (p + lora),
                fp8_cache=2.0 * stage_gemm_params(arch, tp, pp, s, ep) if fp8 else 0.0,
                grads=FP32 * trained,
                # the distributed optimizer shards dense weights over DP·CP, experts over their DP·CP/EP replicas
                optimizer=12.0 * ((trained - trained_experts) / (dp * cp) + trained_experts / (dp * cp // ep))
                if distopt
                else 12.0 * trained,
                activations=min(pp - s, m_update) * stage_layers + stage_working,
                logits=logits,
                forward_pass=forward_pass_bytes(forward_layer, chunk, vocab // tp, tok_gpu, h, tp, last),
                rollout=rollout_held,
                overhead=overhead,
                expert_params=experts,
                lora_params=lora,
            )
        )
    worst = max(stages, key=lambda x: x.total)
    reasons = []
    if worst.total > job.usable:
        reasons.append(_overflow(worst, job.usable))
    kept = max(stages, key=lambda st: st.weights + st.fp8_cache if o.offload_train_state else st.resident)
    resident = (kept.weights + kept.fp8_cache if o.offload_train_state else kept.resident) if o.colocated else 0.0
    if o.colocated:
        # unset: the largest that fits beside the trainer's whole state at start-up and its weights while generating
        rooms = (job.usable - max(st.resident for st in stages) - overhead, job.usable - resident - overhead)
        rollout, why = _rollout(job, o.rollout_mem_fraction, resident, engine_tp, rooms)
    else:
        rollout, why = _rollout(job, o.rollout_mem_fraction or 0.85, resident, engine_tp)
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
                f"start-up phase: the trainer's weights, grads and optimizer states + SGLang at mem_fraction "
                f"{rollout.mem_fraction:.2f} = {phases[2].total / GiB:.1f} > {job.usable / GiB:.1f} GiB "
                "usable before the engines first release their memory (lower rollout.mem_fraction)"
            )
        if not phases[1].fits:
            reasons.append(
                f"rollout phase: trainer keeps {resident / GiB:.1f} GiB + overhead {o.overhead_gb:g} + SGLang "
                f"{rollout.engine_terms.rollout / GiB:.1f} GiB = {phases[1].total / GiB:.1f} > {job.usable / GiB:.1f} GiB usable (lower the "
                "SGLang mem_fraction or offload the train state)"
            )
    if why:
        reasons.append(why)
    if (seqs := o.mini_batch_prompts * o.group_size) < dp:
        reasons.append(f"a mini-batch has {seqs} sequences, fewer than DP = {dp} ranks")
    flops, time_s, bubble = _step_time(
        job,
        vocab,
        tp,
        pp,
        cp,
        dp,
        m_update,
        recompute,
        fp8,
        max(st.lora_params if o.lora_rank else st.params for st in stages),  # what the gradient collectives move
        ep,
        0 if o.lora_rank else max(st.expert_params for st in stages),
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
        ep=ep,
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
    ep: int = 1,
    experts: int = 0,
) -> tuple[float, float, float]:
    """Rough training time of one step (old-logprob pass + all updates), in seconds; returns (FLOPs, s, bubble).

    Dense FLOPs per token: 2·N forward (N = layer GEMM weights + output layer) → old logprobs 2N + train 6N = 8N (LoRA:
    6N, the frozen base's weight gradients not computed);
    recompute adds a forward of what it recomputes (full: 2N; selective: the MLP, 2·3hf per layer). Causal attention:
    2·q·s per layer and token forward (s ≈ mean sequence length), ×4 for the two passes (+1 with full recompute).
    Compute time = FLOPs / (GPUs × peak × MFU × 0.96^log2(TP) × 0.95^log2(CP)) ÷ FP8 speedup, divided by the 1F1B
    efficiency m/(m + PP − 1) (m = micro-batches per update per DP rank). Each update adds a reduce-scatter +
    all-gather of the fp32 grads, not hidden: 2 × 4 B × params/GPU × (n−1)/n over ``dp_bandwidth_gbs`` (n = DP·CP;
    an MoE's ``experts`` over their n/EP replicas). MoE: N counts the experts a token goes through (top-k, and the
    router), and each MoE layer's alltoall dispatch + combine (2 × k × h × 2 B per token, ×3 for the old-logprob
    forward and the training forward and backward, (EP−1)/EP of it leaving the GPU) runs at ``ep_bandwidth_gbs``
    while EP × TP fits in a node, else at ``dp_bandwidth_gbs``, not hidden.
    """
    a = job.arch
    q = a.num_attention_heads * a.head_dim
    n_dense = active_gemm_params(a) + vocab * a.hidden_size
    attn_fwd = 2 * q * job.mean_seq * a.num_layers
    # LoRA: the frozen base's backward computes no weight gradients (2N of its 6N): 6N in all, the adapters' FLOPs
    # (rank / width of the base's) left out
    per_token = (6 if job.opt.lora_rank else 8) * n_dense + 4 * attn_fwd
    dense_layers = sum(not a.is_moe_layer(i) for i in range(a.num_layers))
    if recompute == "full":
        per_token += 2 * n_dense + attn_fwd
    elif recompute == "selective":
        per_token += 2 * 3 * a.hidden_size * a.ffn_hidden_size * dense_layers
    flops = per_token * job.step_tokens
    eff = job.opt.mfu * 0.96 ** math.log2(tp) * 0.95 ** math.log2(cp)
    compute = flops / (job.world * job.opt.peak_tflops * 1e12 * eff) / (job.opt.fp8_speedup if fp8 else 1.0)
    bubble = (pp - 1) / (m_update + pp - 1)
    n = dp * cp
    grads = (params - experts) * (n - 1) / n + (experts * (n // ep - 1) / (n // ep) if experts else 0.0)
    comm = job.updates * 2 * FP32 * grads / (job.dp_bandwidth_gbs * 1e9) if n > 1 else 0.0
    if a.is_moe and ep > 1:
        moe_layers = a.num_layers - dense_layers
        tokens_gpu = job.step_tokens / (dp * cp * tp)  # each TP rank dispatches its sequence-parallel shard
        sent = tokens_gpu * moe_layers / pp * 3 * 2 * a.moe_topk * a.hidden_size * BF16 * (ep - 1) / ep
        bandwidth = job.opt.ep_bandwidth_gbs if ep * tp <= job.gpus_per_node else job.dp_bandwidth_gbs
        comm += sent / (bandwidth * 1e9)
    return flops, compute / (1 - bubble) + comm, bubble
