"""The memory model: exact parameter counts of our megatron-core GPTModel, activation bytes per token, and the
actor's peak on one rank — what the planner (``plan.py``) and the actor's default micro-batch budget rest on.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.models.arch import ArchConfig, padded_vocab_size

GiB = 1024**3
BF16, FP32 = 2, 4
RECOMPUTE = ("none", "selective", "full")
# Selective recompute = megatron-core recompute_granularity="selective" with these modules; full = "full"/"uniform"/1.
SELECTIVE_MODULES = ["core_attn", "layernorm", "mlp"]


# ----------------------------------------------------------------------------------------------------------------------
# Parameter counting


def _check_split(arch: ArchConfig, tp: int, pp: int) -> None:
    if tp < 1 or pp < 1:
        raise ValueError(f"tp = {tp}, pp = {pp}: must be >= 1")
    for key in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        if getattr(arch, key) % tp:
            raise ValueError(f"{arch.name}: {key} = {getattr(arch, key)} is not divisible by tp = {tp}")
    if arch.num_layers % pp:
        raise ValueError(f"{arch.name}: num_layers = {arch.num_layers} is not divisible by pp = {pp}")
    if arch.is_moe and arch.moe_ffn_hidden_size % tp:
        raise ValueError(f"{arch.name}: moe_ffn_hidden_size = {arch.moe_ffn_hidden_size} is not divisible by tp = {tp}")


def layer_gemm_params(arch: ArchConfig, tp: int = 1) -> int:
    """Weights of the four GEMMs of one layer on one TP rank: QKV, proj, fc1 (gated: 2·ffn rows), fc2."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    qkv = (arch.num_attention_heads + 2 * arch.num_query_groups) * d * h
    proj = h * arch.num_attention_heads * d
    return (qkv + proj + 2 * f * h + h * f) // tp


def local_expert_params(arch: ArchConfig, tp: int = 1, ep: int = 1) -> int:
    """The experts of one MoE layer on one TP x EP rank: experts / EP SwiGLU experts, each split over TP (expert
    TP = TP)."""
    return arch.num_experts // ep * 3 * arch.moe_ffn_hidden_size * arch.hidden_size // tp


def moe_mlp_params(arch: ArchConfig, tp: int = 1, ep: int = 1) -> int:
    """The MLP of one MoE layer on one TP x EP rank: the router [experts, h] (replicated) and its local experts."""
    return arch.num_experts * arch.hidden_size + local_expert_params(arch, tp, ep)


def layer_params(arch: ArchConfig, tp: int = 1, layer: int = 0, ep: int = 1) -> int:
    """One transformer layer (global index ``layer``) on one TP (x EP) rank: 2 RMSNorm weights (replicated) + GEMMs +
    the QKV bias + the per-head q/k RMSNorm weights (qk_layernorm: [head_dim] each, replicated); an MoE layer has the
    router and its share of the experts in place of the dense MLP."""
    qkv_bias = (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.head_dim // tp if arch.qkv_bias else 0
    qk_norm = 2 * arch.head_dim if arch.qk_layernorm else 0
    gemms = layer_gemm_params(arch, tp)
    if arch.is_moe_layer(layer):
        gemms += moe_mlp_params(arch, tp, ep) - 3 * arch.ffn_hidden_size * arch.hidden_size // tp
    return 2 * arch.hidden_size + gemms + qkv_bias + qk_norm


def count_params(
    arch: ArchConfig, tp: int = 1, pp: int = 1, pp_rank: int = 0, padded_vocab: int | None = None, ep: int = 1
) -> int:
    """Parameters held by one GPU (one TP (x EP) rank of pipeline stage ``pp_rank``) of our megatron-core GPTModel.

    First stage: word embedding [padded_vocab/TP, h]. Every stage: num_layers/PP layers (``layer_params``).
    Last stage: final RMSNorm [h] and the output layer [padded_vocab/TP, h] — when embeddings are untied, or when
    they are tied and PP > 1 (megatron keeps a copy of the embedding on the last stage, kept equal by an all-reduce).
    RoPE has no parameters. ``padded_vocab`` defaults to ``padded_vocab_size(arch.vocab_size, tp)``.
    """
    _check_split(arch, tp, pp)
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank = {pp_rank}: must be in [0, {pp})")
    vocab = padded_vocab if padded_vocab is not None else padded_vocab_size(arch.vocab_size, tp)
    if vocab % tp:
        raise ValueError(f"padded_vocab = {vocab} is not divisible by tp = {tp}")
    h = arch.hidden_size
    per = arch.num_layers // pp
    n = sum(layer_params(arch, tp, layer, ep) for layer in range(pp_rank * per, (pp_rank + 1) * per))
    if pp_rank == 0:
        n += vocab // tp * h
    if pp_rank == pp - 1:
        n += h
        if not arch.tie_embeddings or pp > 1:
            n += vocab // tp * h
    return n


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def lora_params(
    arch: ArchConfig, rank: int, tp: int = 1, pp: int = 1, pp_rank: int = 0, targets: tuple[str, ...] = LORA_TARGETS
) -> int:
    """LoRA adapters held by one GPU of stage ``pp_rank`` (``actor/lora.py``): per layer and target, A [r, in] and
    B [out, r], the split one ÷ TP (column-parallel ``linear_qkv`` / ``linear_fc1``: B's rows; row-parallel
    ``linear_proj`` / ``linear_fc2``: A's columns). A mixture's experts are not adapted; its dense layers' MLPs are."""
    if not rank:
        return 0
    h, q, kv = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    per = arch.num_layers // pp
    n = 0
    for layer in range(pp_rank * per, (pp_rank + 1) * per):
        mlp = not arch.is_moe_layer(layer)
        f = arch.ffn_hidden_size
        sizes = {  # (A's columns, B's rows) on this rank
            "linear_qkv": (h, (q + 2 * kv) // tp),
            "linear_proj": (q // tp, h),
            "linear_fc1": (h, 2 * f // tp) if mlp else None,
            "linear_fc2": (f // tp, h) if mlp else None,
        }
        n += sum(rank * (a + b) for t, (a, b) in ((t, s) for t, s in sizes.items() if s) if t in targets)
    return n


def expert_params(arch: ArchConfig, tp: int = 1, pp: int = 1, pp_rank: int = 0, ep: int = 1) -> int:
    """Of ``count_params``, the experts' weights (what the distributed optimizer shards over the expert-data-parallel
    group, DP·CP/EP ranks, where the rest is sharded over DP·CP)."""
    if not arch.is_moe:
        return 0
    per = arch.num_layers // pp
    layers = sum(arch.is_moe_layer(i) for i in range(pp_rank * per, (pp_rank + 1) * per))
    return layers * local_expert_params(arch, tp, ep)


def stage_gemm_params(arch: ArchConfig, tp: int = 1, pp: int = 1, pp_rank: int = 0, ep: int = 1) -> int:
    """The GEMM weights of one rank's layers (QKV, proj, fc1, fc2; an MoE layer's local experts, not its router):
    what TE keeps an FP8 copy and transpose of."""
    per = arch.num_layers // pp
    dense_mlp = 3 * arch.ffn_hidden_size * arch.hidden_size // tp
    n = 0
    for layer in range(pp_rank * per, (pp_rank + 1) * per):
        n += layer_gemm_params(arch, tp)
        if arch.is_moe_layer(layer):
            n += local_expert_params(arch, tp, ep) - dense_mlp
    return n


def active_gemm_params(arch: ArchConfig) -> int:
    """The GEMM weights one token goes through (FLOPs): every layer's attention, the dense MLPs, and in an MoE
    layer the router and ``moe_topk`` experts."""
    h, d = arch.hidden_size, arch.head_dim
    attention = (2 * arch.num_attention_heads + 2 * arch.num_query_groups) * d * h
    n = 0
    for layer in range(arch.num_layers):
        if arch.is_moe_layer(layer):
            n += attention + arch.num_experts * h + arch.moe_topk * 3 * arch.moe_ffn_hidden_size * h
        else:
            n += attention + 3 * arch.ffn_hidden_size * h
    return n


def total_params(arch: ArchConfig, padded_vocab: int | None = None) -> int:
    """The whole model (TP = PP = 1); with the real vocabulary unless ``padded_vocab`` is given."""
    return count_params(arch, 1, 1, 0, padded_vocab if padded_vocab is not None else arch.vocab_size)


# ----------------------------------------------------------------------------------------------------------------------
# Activations


def activation_bytes_per_token(
    arch: ArchConfig,
    recompute: str = "none",
    *,
    flash: bool = True,
    attn_seq_len: int = 0,
    gated: bool = True,
    dropout: bool = False,
    rope_qk: bool = True,
    tp: int | None = None,
) -> float:
    """Bytes one layer keeps for the backward pass per token (16-bit activations, 1-byte dropout masks), before ÷TP.

    Korthikanti et al. 2022, term by term, with q = heads·head_dim, kv = kv_heads·head_dim, f = ffn size:
      norms:      2 inputs · 2h                                            (their 4sbh)
      attention:  QKV input 2h + Q,K,V 2(q + 2kv) + proj input 2q + dropout mask h   (their 11sbh for MHA)
                  + softmax 2as + its dropout mask as + dropout output 2as = 5as      (gone with flash attention)
      MLP:        fc1 input 2h + activation input 2f·(2 if gated) + fc2 input 2f + dropout mask h   (their 19sbh)
      RoPE:       (``rope_qk``) the rotated q and k are new tensors attention keeps, beside the fused QKV output
                  that v's view keeps alive: 2(q + kv) more, measured by ``dapo rehearse``'s step; the unfused
                  RoPE's cos/sin tables are not split by TP (``rope_table_bytes_per_token``). With qk_layernorm the
                  norms add their fp32 1/rms only (their inputs are views of the QKV output), except where a TP rank
                  holds more than one query group (``tp`` given, num_query_groups / tp > 1): the query, split from the
                  fused output group by group, is reshaped to heads by a copy (megatron-core 0.16.1 attention.py:1463),
                  which q_layernorm keeps: 2q more (measured by the step: 32 MiB per layer and micro-batch of 8192
                  tokens for 4 groups at TP 2)
    With MHA, f = 4h, no gating and dropout this is 34h + 5·a·s. ``attn_seq_len`` (s) is the length the attention
    scores span: for a packed micro-batch with a dense block-diagonal mask, all its tokens. Every family: gated (SwiGLU),
    no dropout. Selective (``SELECTIVE_MODULES``): layer-norm outputs, the core attention and the MLP are recomputed,
    leaving the 2 norm inputs, Q/K/V and the proj input. Full: only the layer input, 2h.
    """
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_query_groups * arch.head_dim
    mask = h if dropout else 0
    # qk_layernorm: the norms' inputs are the q and k parts of the fused QKV output (counted), their 1/rms fp32 per head
    qk_norm = 4 * (arch.num_attention_heads + arch.num_query_groups) if arch.qk_layernorm else 0
    if arch.qk_layernorm and tp is not None and arch.num_query_groups // tp > 1:
        qk_norm += 2 * q  # the query reshaped by a copy (attention.py:1463), q_layernorm's input
    # RoPE makes new q and k (megatron-core rope_utils.py:92-126), which attention keeps, while v, a view of the fused
    # QKV output (attention.py get_query_key_value_tensors: torch.split), keeps that whole output alive
    rope = 2 * (q + kv) if rope_qk else 0
    if recompute == "full":
        return 2 * h
    if recompute == "selective":
        return 4 * h + 2 * (q + 2 * kv) + 2 * q + mask + qk_norm + rope
    if recompute != "none":
        raise ValueError(f"recompute = {recompute!r}: must be one of {', '.join(RECOMPUTE)}")
    norms = 4 * h
    attention = 2 * h + 2 * (q + 2 * kv) + 2 * q + mask + qk_norm + rope
    if not flash:
        attention += 5 * arch.num_attention_heads * attn_seq_len
    mlp = 2 * h + 2 * f * (2 if gated else 1) + 2 * f + mask
    return norms + attention + mlp


def rope_table_bytes_per_token(arch: ArchConfig) -> float:
    """Per layer and token, not split by TP: the cos and sin tables megatron-core's unfused RoPE casts for q and for
    k and keeps for the backward (rope_utils.py:122-125, ``t * cos_``, ``rotate_half(t) * sin_``), 16-bit."""
    return 4 * arch.head_dim * BF16


def backward_working_bytes(arch: ArchConfig, tokens: int, tp: int) -> float:
    """What a dense layer's backward holds at once beyond the saved activations, for a micro-batch of ``tokens`` on
    one GPU: the gradients of the fc1 output (gated: 2f) and of the SwiGLU's output (f), 16-bit, split over TP
    (6f/TP B per token); with TP > 1, sequence parallelism's all-gather buffer of the layer's input (2h B per token,
    megatron-core's global memory buffer, kept between layers). Measured by ``dapo rehearse``'s step. An MoE layer's
    working set is ``moe_working_bytes`` (its experts run one after another: their gradients are not what peaks)."""
    f = arch.ffn_hidden_size
    return tokens * (6.0 * f / tp + (2.0 * arch.hidden_size if tp > 1 else 0.0))


def logits_bytes(chunk: int, vocab_per_gpu: int, tokens: int, hidden: int) -> float:
    """The last stage's head in a training micro-batch (``actor/logprobs.py``: the logits formed ``chunk`` tokens at a
    time and recomputed in backward): per chunk element the fp32 logits and their gradient with the 16-bit product,
    6 B (measured by ``dapo rehearse``'s step), plus the final hidden states gathered from sequence parallelism and
    their copy at the response positions (2 × tokens × h × 2 B)."""
    return chunk * vocab_per_gpu * 6.0 + 2.0 * tokens * hidden * BF16


def forward_pass_bytes(one_layer: float, chunk: int, vocab_per_gpu: int, tokens: int, hidden: int, tp: int,
                       last: bool) -> float:  # fmt: skip
    """A forward-only pass's peak over the resident state (the old-logprob pass): one layer's activations at a time
    with the residual stream around it (the layer's input, its attention output and their sum: 3 × 2h B per token
    ÷ TP) and sequence parallelism's gather buffer (2h B per token); on the last stage, once the layers are done,
    the head instead: the gathered hidden states, their copy at the response positions and one more (3 × 2h), and
    per chunk element 16 B (the 16-bit logits, their fp32 copy, the padded vocabulary masked on a copy, and the
    entropy's shifted exponentials; ``actor/logprobs.py``). Measured by ``dapo rehearse``'s step."""
    buffer = 2.0 * hidden * tokens if tp > 1 else 0.0
    layers = one_layer + 3 * 2.0 * hidden * tokens / tp + buffer
    head = buffer + 3 * 2.0 * hidden * tokens + chunk * vocab_per_gpu * 16.0
    return max(layers, head) if last else layers


def _routed(arch: ArchConfig, imbalance: float, ep: int) -> float:
    """Routed copies per token that an expert-parallel rank's experts run on: ``moe_topk``, × ``imbalance`` on the
    busiest EP rank when EP > 1. With EP = 1 every rank holds every expert and gets exactly ``moe_topk`` copies of
    each token of its TP group whatever the routing (the all-to-all is the identity: megatron-core 0.16.1
    tensor_parallel/mappings.py:430): no imbalance is possible."""
    return arch.moe_topk * (imbalance if ep > 1 else 1.0)


def moe_layer_activation_delta(arch: ArchConfig, recompute: str, tp: int, imbalance: float = 1.0, ep: int = 1) -> float:
    """What an MoE layer keeps per token beyond ``activation_bytes_per_token`` (whose dense MLP it replaces), per GPU
    and per token of the micro-batch on that GPU (already split over TP where megatron-core splits it). megatron-core
    0.16.1 with the alltoall dispatcher, ``SequentialMLP`` experts and expert TP = TP (``actor/provider.py``
    ``moe_kwargs``), measured by ``dapo rehearse``'s step.

    The router, on the sequence-parallel shard (÷TP): its input 2h (``RouterGatingLinearFunction`` keeps it in
    16 bits, moe_utils.py:1185), the top-k's indices 8k and the softmax over the k chosen logits 4k
    (moe_utils.py:714-715), the aux loss's softmax over all experts (fp32, 4E) and its top-k indices 8k
    (moe_utils.py:781, :788), ``permute``'s ``masked_select`` input and mask (the probabilities transposed, fp32 4E,
    and the routing map, E: moe_utils.py:372) and its token indices 8k (``index_select``, :377): 2h + 9E + 28k.
    The experts, after the alltoall dispatcher's EP exchange and its all-gather over TP (expert TP = TP: every TP rank
    holds all routed copies of its TP group, f split over TP), per routed copy: the experts' input 2h (fc1's), the
    fc1 output 4f/TP and its probability 4 B (the weighted SwiGLU's: mlp.py:170-180, fused_bias_swiglu.py:196) and
    the SwiGLU's output 2f/TP (fc2's); ``_routed`` copies per token. The experts' output is not kept: the weighted
    SwiGLU applies the routing probabilities inside each expert, so the combine's ``unpermute`` takes none
    (token_dispatcher.py:833). (This replaced 2h + 4E + 20k, a kept output 2h per copy and the imbalance at any EP:
    the step measured 614.7 MiB per layer and micro-batch where that said 1001, 128 experts of 16, 8192 tokens, TP 2.)
    Selective recompute re-runs only the core attention (megatron-core's default ``recompute_modules``), never the
    experts; full keeps the input, and the recomputed layer's activations are ``moe_working_bytes``'s.
    """
    if recompute == "full":
        return 0.0
    h, f, k, e = arch.hidden_size, arch.moe_ffn_hidden_size, arch.moe_topk, arch.num_experts
    dense_mlp = 0 if recompute == "selective" else 2 * h + 6 * arch.ffn_hidden_size
    router = 2 * h + 9 * e + 28 * k
    experts = _routed(arch, imbalance, ep) * (2 * h + 6 * f / tp + 4)
    return (router - dense_mlp) / tp + experts


def moe_dispatch_bytes(arch: ArchConfig, tokens: int, imbalance: float = 1.0, tp: int = 1, ep: int = 1) -> float:
    """What the running MoE layer holds at its combine beyond what it keeps for the backward, for a micro-batch of
    ``tokens`` on one TP group (``R = tokens × _routed`` copies on each TP rank after the TP all-gather; this rank's own
    ``tokens / TP × k``, what it permutes and gets back): the experts' outputs concatenated (experts.py:925, R × 2h)
    and put back in source order (``sort_chunks_by_idxs``, moe_utils.py:506: R × 2h, with more than one local expert);
    with TP > 1 their fp32 copy for the reduce-scatter (``.to(probs.dtype)``: the router runs in fp32,
    token_dispatcher.py:780, R × 4h) and its output (R / TP × 4h); the rank's permuted copies, alive in
    ``MoELayer.forward`` (moe_utils.py:377, tokens / TP × k × 2h) and with EP > 1 the all-to-all's output
    (× ``imbalance``). Measured by ``dapo rehearse``'s step: the peak of a recomputed MoE layer is at the combine's
    reduce-scatter (mappings.py:192). (This replaced 2 × tokens × k × imbalance × 2h, the sent and received buffers
    alone: 640 MiB where the step measured 1,408 at 8192 tokens, k 8, h 2048, TP 2.)"""
    if not arch.is_moe:
        return 0.0
    h, k = arch.hidden_size, arch.moe_topk
    r = tokens * _routed(arch, imbalance, ep)
    mine = tokens / tp * k
    local_experts = arch.num_experts // ep
    out = r * 2 * h * (2 if local_experts > 1 else 1)
    if tp > 1:
        out += r * 4 * h + r / tp * 4 * h
    out += mine * 2 * h * (1 + (imbalance if ep > 1 else 0.0))
    return out


def moe_working_bytes(arch: ArchConfig, tokens: int, tp: int, imbalance: float = 1.0, ep: int = 1) -> float:
    """An MoE layer's peak beyond the activations the stage keeps, for a micro-batch of ``tokens`` on one TP group:
    ``moe_dispatch_bytes`` at its combine, sequence parallelism's all-gather buffer (2h per token, TP > 1) and the
    gradient arriving from the layer above (2h per token ÷ TP). Under full recompute the layer runs its forward again
    inside the backward and the planner adds the whole layer's activations (``activation_bytes_per_token`` +
    ``moe_layer_activation_delta``, as if not recomputed). Measured by ``dapo rehearse``'s step."""
    h = arch.hidden_size
    return moe_dispatch_bytes(arch, tokens, imbalance, tp, ep) + 2.0 * h * tokens * (1.0 / tp + (1 if tp > 1 else 0))


def moe_forward_bytes(arch: ArchConfig, tokens: int, tp: int, imbalance: float = 1.0, ep: int = 1) -> float:
    """An MoE layer's peak in a forward-only pass (the old-logprob pass), for a micro-batch of ``tokens`` on one TP
    group: ``moe_dispatch_bytes`` at its combine, the experts' input (alive in ``MoELayer.routed_experts_compute``,
    tokens × ``_routed`` × 2h) and the router's input (2h per token ÷ TP). ``forward_pass_bytes`` adds the residual
    stream and the all-gather buffer. Measured by ``dapo rehearse``'s step."""
    h = arch.hidden_size
    return moe_dispatch_bytes(arch, tokens, imbalance, tp, ep) + tokens * (
        _routed(arch, imbalance, ep) * 2 * h + 2 * h / tp
    )


def moe_retained_bytes(arch: ArchConfig, tokens: int, tp: int, moe_layers: int, after_update: bool = False) -> float:
    """Under full recompute, what a stage's MoE layers keep from the backward of their last micro-batch until their
    next forward: the alltoall dispatcher keeps the routing probabilities (``self.probs``, token_dispatcher.py:610),
    which hold the recomputed forward's autograd graph, down to the checkpoint's detached input (a leaf: its
    ``AccumulateGrad`` keeps it, and its gradient) — 2h per token ÷ TP each. In the update the layers above the one
    being recomputed hold their input's gradient (the input itself is counted in flight): (MoE layers − 1) × 2h;
    ``after_update`` (the next pass, forward only): the input and its gradient of the layers the pass has not reached
    yet, at most (MoE layers − 1) × 4h (the step measured one layer fewer at the pass's peak). Measured by
    ``dapo rehearse``'s step (it vanishes when the dispatcher's probabilities are detached after the combine)."""
    per = (4.0 if after_update else 2.0) * arch.hidden_size * tokens / tp
    return max(moe_layers - 1, 0) * per


# ----------------------------------------------------------------------------------------------------------------------
# The actor's peak on one rank (what sizes the default micro-batch budget)


def local_activation_bytes_per_token(
    arch: ArchConfig, attn_seq_len: int, dtype_bytes: int = 4, heap_factor: float = 1.0
) -> float:
    """Bytes one layer of megatron-core's LOCAL spec (CPU, padded [B, L] micro-batches) keeps for the backward pass
    per token, counted from autograd's saved tensors (megatron-core 0.16.1, torch 2.13; ``tests/unit/
    test_memory_measured.py`` counts them again), with q = heads·head_dim, kv = kv_heads·head_dim, f = ffn size:
      norms:      2 × (input, x·rsqrt(mean x²), output) = 6h; a 16-bit model's norms also keep an fp32 copy (2 × 4h B)
      attention:  q after RoPE, the context copy, and K, V repeated to q heads (GQA: repeat_interleave) = 4q;
                  without GQA, K after RoPE and the fused QKV output instead: 3q + 3kv
      scores:     the softmax output, heads · s per token (fp32; a 16-bit model adds its 16-bit copy)
      MLP:        fc1 output 2f, SiLU output, the gated product and fc2's input: 5f
      q/k norms:  (qk_layernorm) their input and output in the model's dtype and an fp32 normalized copy: (2d + 4)(q + kv)
    s = ``attn_seq_len`` (the longest row of the micro-batch). ``heap_factor`` scales all but the scores (the
    allocator's share, see ``LOCAL_HEAP_FACTOR``). Unlike ``activation_bytes_per_token`` (TE's fused
    kernels), nothing here is fused, and every tensor is in the model's dtype."""
    d = dtype_bytes
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_query_groups * arch.head_dim
    gqa = arch.num_attention_heads > arch.num_query_groups
    norms = 6 * h * d + (8 * h if d < 4 else 0)
    attention = (4 * q if gqa else 3 * q + 3 * kv) * d
    if arch.qk_layernorm:
        attention += (2 * d + 4) * (q + kv)
    scores = arch.num_attention_heads * attn_seq_len * (4 + (d if d < 4 else 0))
    return (norms + attention + 5 * f * d) * heap_factor + scores


# What the peak RSS holds beyond the saved tensors on CPU, measured (tests/unit/test_memory_measured.py): glibc's
# heap keeps the pages of freed tensors smaller than its mmap threshold (which rises to 32 MiB as tensors are freed),
# so the resident size of the activations is this factor × what autograd keeps; and the backward of the last layer
# holds about three more copies of its attention scores (the gradients of the probabilities and of the scores).
LOCAL_HEAP_FACTOR = 1.5
LOCAL_BACKWARD_SCORE_COPIES = 3
BASE_BYTES = 0.6 * GiB  # torch, megatron-core and transformers imported, the process's own allocations


@dataclass
class ActorMemory:
    """Bytes one rank of the actor holds at its peak (the first pipeline stage, during a training micro-batch)."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    engine: float  # an in-process rollout engine's copy of the model (the CPU HF engine on rank 0)
    base: float = BASE_BYTES

    @property
    def fixed(self) -> float:
        """Everything but the activations (which scale with the micro-batch)."""
        return self.weights + self.grads + self.optimizer + self.logits + self.engine + self.base

    @property
    def total(self) -> float:
        return self.fixed + self.activations

    def explain(self) -> str:
        rows = [(k, getattr(self, k)) for k in ("weights", "grads", "optimizer", "activations", "logits", "engine")]
        rows.append(("process", self.base))
        return ", ".join(f"{k} {v / GiB:.2f}" for k, v in rows) + f" = {self.total / GiB:.2f} GiB"


def actor_memory(
    arch: ArchConfig,
    micro_batch_tokens: int,
    max_seq_len: int,
    *,
    dtype_bytes: int = 4,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    layout: str = "padded",
    recompute: str = "none",
    distributed_optimizer: bool = False,
    logprob_chunk_tokens: int = 1024,
    engine_bytes_per_param: int = 0,
    lora_rank: int = 0,
    lora_targets: tuple[str, ...] = LORA_TARGETS,
) -> ActorMemory:
    """The peak of one rank: resident state (weights, fp32 main grads, Adam: 8 B/param for fp32 weights, 12 with a
    16-bit model's fp32 master copy, ÷ DP with the distributed optimizer), the activations of ``pp`` micro-batches in
    flight on stage 0, one logits chunk, and an in-process engine's copy of the whole model.

    Padded micro-batches (local spec, ``local_activation_bytes_per_token``) attend densely over their longest row,
    at most ``max_seq_len`` (with shared prompts a row holds a prompt and its group's responses: pass that bound);
    THD rows (TE, ``activation_bytes_per_token``) use flash attention, which keeps no scores. Measured against the
    peak RSS of real train steps on CPU in ``tests/unit/test_memory_measured.py``."""
    params = count_params(arch, tp, pp, 0)
    # LoRA (model.lora): the adapters train, the frozen base keeps its weights only
    trained = lora_params(arch, lora_rank, tp, pp, 0, lora_targets) if lora_rank else params
    optimizer = trained * (8 if dtype_bytes == 4 else 12) / (dp if distributed_optimizer else 1)
    flash = layout == "thd"
    layers = arch.num_layers // pp
    if flash:
        per_token = activation_bytes_per_token(arch, recompute, flash=True) * dtype_bytes / 2
        # 1F1B keeps up to PP micro-batches in flight on stage 0; TE runs sequence parallel (÷ TP)
        activations = per_token * layers * micro_batch_tokens * pp / tp
    else:
        # the local spec counted as it runs; recompute scales it as it scales the 16-bit accounting
        per_token = local_activation_bytes_per_token(arch, max_seq_len, dtype_bytes, LOCAL_HEAP_FACTOR)
        if recompute != "none":
            per_token *= activation_bytes_per_token(arch, recompute, flash=False, attn_seq_len=max_seq_len) / (
                activation_bytes_per_token(arch, "none", flash=False, attn_seq_len=max_seq_len)
            )
        backward = LOCAL_BACKWARD_SCORE_COPIES * arch.num_attention_heads * max_seq_len * dtype_bytes
        activations = (per_token * layers * pp + backward) * micro_batch_tokens
    chunk = min(logprob_chunk_tokens, micro_batch_tokens)
    logits = chunk * padded_vocab_size(arch.vocab_size, tp) / tp * 16  # fp32 logits, log-softmax, grad, recompute
    return ActorMemory(
        weights=(params + (trained if lora_rank else 0)) * dtype_bytes,
        grads=trained * FP32,
        optimizer=optimizer,
        activations=activations,
        logits=logits,
        engine=total_params(arch) * engine_bytes_per_param,
    )


def fit_micro_batch_tokens(arch: ArchConfig, max_seq_len: int, available: float, **kw) -> int:
    """The largest micro-batch token budget whose ``actor_memory`` peak stays within ``available`` bytes (kw as for
    ``actor_memory``); 0 when not even the resident state fits."""
    one = actor_memory(arch, 1, max_seq_len, **kw)
    full_chunk = actor_memory(arch, kw.get("logprob_chunk_tokens", 1024), max_seq_len, **kw)
    room = available - full_chunk.fixed
    return max(0, int(room // one.activations)) if room > 0 else 0


# ----------------------------------------------------------------------------------------------------------------------
# One phase's peak (plan.py fills them: a colocated GPU holds the trainer and SGLang)


@dataclass
class PhaseMemory:
    """Per-GPU bytes at the peak of one phase (``train``, ``rollout``, ``startup``), term by term: (name, bytes, why)."""

    phase: str
    rows: list[tuple[str, float, str]]
    usable: float

    @property
    def total(self) -> float:
        return sum(v for _, v, _ in self.rows)

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def explain(self) -> str:
        lines = [f"{self.phase} phase, per GPU (GiB):"]
        lines += [f"  {name:<22}{value / GiB:8.2f}   {why}" for name, value, why in self.rows]
        verdict = "fits" if self.fits else "DOES NOT FIT"
        return "\n".join(
            lines + [f"  {'peak':<22}{self.total / GiB:8.2f}   of {self.usable / GiB:.1f} usable: {verdict}"]
        )


def train_phase(m, usable: float, opt_div: int) -> PhaseMemory:
    """The trainer's peak (``plan.Memory`` of its worst stage) while the engines are released."""
    rows = [
        (
            "trainer weights",
            m.weights + m.fp8_cache,
            f"{m.params / 1e9:.2f} B params × 2 B (bf16)"
            + (" + FP8 copy and transpose of the GEMM weights" if m.fp8_cache else ""),
        ),
        ("trainer grads", m.grads, "params × 4 B (fp32 main grads)"),
        ("trainer optimizer", m.optimizer, f"params × 12 B / {opt_div} (fp32 master + 2 Adam moments)"),
        ("trainer activations", m.activations, f"micro-batches in flight on stage {m.stage}"),
        ("trainer logits", m.logits, "one log-softmax chunk (last stage)"),
        ("SGLang (released)", m.rollout, "what a released engine keeps (context, allocator)"),
        ("overhead", m.overhead, "CUDA context, NCCL, fragmentation"),
    ]
    return PhaseMemory("train", rows, usable)


def rollout_phase(m, r, o, usable: float) -> PhaseMemory:
    """Generation: the trainer's weights (its grads and optimizer states offloaded unless ``o.offload_train_state`` is
    off) + the engine's ``mem_fraction`` (weights + KV cache) + its CUDA graphs, which SGLang allocates outside
    ``mem_fraction`` (``plan.Rollout`` ``r``, ``plan.PlanOptions`` ``o``). When ``r`` carries SGLang's own terms
    (``r.engine_terms``: SGLang's ``engines.sglang.memory.SGLangMemory``) the engine's rows are those, activations included, and
    ``overhead`` is the trainer's alone."""
    off = o.offload_train_state
    kv = max(r.share - r.weights, 0.0)
    rows = [
        ("trainer weights", m.weights + m.fp8_cache, f"stage {m.stage}'s parameters stay on the GPU"),
        ("trainer grads", 0.0 if off else m.grads, "offloaded to the host" if off else "kept"),
        ("trainer optimizer", 0.0 if off else m.optimizer, "offloaded to the host" if off else "kept"),
    ]
    if r.engine_terms is not None:  # the engine's own terms (SGLang's: engines/sglang/memory.py)
        return PhaseMemory(
            "rollout", rows + r.engine_terms.rows(r.engine_tp, "rollout") + [_trainer_overhead(o)], usable
        )
    rows += [
        ("SGLang weights", r.weights, f"the whole model (bf16) / TP{r.engine_tp}"),
        ("SGLang KV cache", kv, f"mem_fraction {r.mem_fraction:.2f} × GPU − weights: {r.kv_tokens:,} tokens/engine"),
        ("SGLang CUDA graphs", o.cuda_graph_gb * GiB, "captured decode graphs, outside mem_fraction"),
        ("overhead", o.overhead_gb * GiB, "CUDA contexts, NCCL, fragmentation"),
    ]
    return PhaseMemory("rollout", rows, usable)


def startup_phase(m, r, o, usable: float, opt_div: int) -> PhaseMemory:
    """Before the first release (``MemoryPhases.__init__`` offloads the trainer and releases the engines only once
    both are up): the trainer's whole resident state — weights, the DDP grad buffers, and the optimizer states a
    resumed run has just loaded — next to engines that hold their whole ``mem_fraction`` and CUDA graphs (with
    ``r.engine_terms``: the engine's own start-up terms, see ``rollout_phase``)."""
    rows = [
        ("trainer weights", m.weights + m.fp8_cache, f"stage {m.stage}'s parameters"),
        ("trainer grads", m.grads, "the DDP grad buffers, allocated when the model is wrapped"),
        ("trainer optimizer", m.optimizer, f"params × 12 B / {opt_div}: loaded by a resumed run before the offload"),
    ]
    if r.engine_terms is not None:  # the engine's own terms (SGLang's: engines/sglang/memory.py)
        return PhaseMemory(
            "startup", rows + r.engine_terms.rows(r.engine_tp, "startup") + [_trainer_overhead(o)], usable
        )
    rows += [
        ("SGLang weights + KV", r.share, f"mem_fraction {r.mem_fraction:.2f} × GPU, allocated at server start"),
        ("SGLang CUDA graphs", o.cuda_graph_gb * GiB, "captured at server start"),
        ("overhead", o.overhead_gb * GiB, "CUDA contexts, NCCL, fragmentation"),
    ]
    return PhaseMemory("startup", rows, usable)


def _trainer_overhead(o) -> tuple[str, float, str]:
    return ("overhead", o.overhead_gb * GiB, "the trainer's CUDA context, NCCL, fragmentation")
