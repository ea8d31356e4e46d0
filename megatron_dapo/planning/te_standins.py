"""What the rehearsal builds where the GPU job has Transformer Engine modules that a CPU cannot import.

The rehearsal's step (``planning/rank_step.py``) runs megatron-core's local layer spec with exactly two kinds of
module swapped, each an ``autograd.Function`` that keeps for the backward pass what TE's kernel keeps, and nothing
else (fake tensors hold no data, so only shapes, dtypes and lifetimes matter):

| TE module (GPU job) | stand-in | kept for backward |
|---|---|---|
| ``TEDotProductAttention`` (fused / flash attention, THD) | ``FlashAttentionStandIn`` | q, k, v, out, fp32 softmax stats [heads, tokens] |
| ``TENorm`` / the norm of ``TELayerNormColumnParallelLinear`` (RMSNorm) | ``RMSNormStandIn`` | the input, fp32 1/rms per token |

References (TransformerEngine 2.x): ``transformer_engine/pytorch/attention/dot_product_attention/backends.py``,
``FusedAttnFunc.forward`` saves ``q, k, v, out`` and the ``aux_ctx_tensors`` (softmax statistics ``[b, h, s, 1]``
fp32, the RNG state); ``transformer_engine/pytorch/module/layernorm_linear.py`` ``_LayerNormLinear.forward`` saves
the norm's input, ``rsigma`` and the norm's output that feeds the GEMM (the GEMM's saved input, which the local
spec's ``ColumnParallelLinear`` keeps as its own input here). megatron-core's fused SwiGLU
(``fusions/fused_bias_swiglu.py`` ``SwiGLUFunction``: saves its input only) is what the TE spec runs and runs here
too (``bias_activation_fusion`` on, with ``torch.compile`` off: fake tensors are not compiled).

What stays different, and is modelled instead: the FP8 weight copies (TE's ``Float8Tensor`` caches, from the GEMM
weights), context parallelism (TE's ring attention p2p: the rehearsal refuses ``parallel.cp > 1``), and TE's
workspaces (cuBLAS, cuDNN), which the overhead term holds.
"""

from __future__ import annotations

import copy

import torch

# ----------------------------------------------------------------------------------------------------------------------
# Core attention


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, heads_dim: int):
        out = torch.empty_like(q)
        stats = q.new_empty((q.shape[heads_dim], q.numel() // (q.shape[heads_dim] * q.shape[-1])), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, stats)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, _out, _stats = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


class FlashAttentionStandIn(torch.nn.Module):
    """In place of ``TEDotProductAttention``: causal attention over packed THD rows (``packed_seq_params``) or
    [s, b, heads, dim] ones, with flash attention's memory (module docstring). The output has no meaningful
    values: only fake tensors go through it."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
        super().__init__()
        self.config = config

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        out = _FlashAttention.apply(query, key, value, -2)
        if thd:
            return out  # [t, heads, dim]: megatron's Attention reshapes it to [t, 1, h]
        return out.reshape(out.shape[0], out.shape[1], -1)  # [s, b, heads·dim]


# ----------------------------------------------------------------------------------------------------------------------
# RMSNorm


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        rsigma = x.new_empty(x.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(x, weight, rsigma)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), None


class RMSNormStandIn(torch.nn.Module):
    """In place of ``TENorm`` (RMSNorm): one weight [hidden] (or [head_dim] for q/k norms), marked
    ``sequence_parallel`` as TE marks it, so megatron-core all-reduces its gradient over TP under sequence
    parallelism (``distributed/finalize_model_grads.py``); the backward keeps the input and 1/rms."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x):
        return _RMSNorm.apply(x, self.weight, self.eps)


# ----------------------------------------------------------------------------------------------------------------------
# Specs


def _swap(layer_spec, qk_layernorm: bool):
    """A copy of a local-spec ``TransformerLayer`` spec with the stand-ins in TE's places."""
    spec = copy.deepcopy(layer_spec)
    sub = spec.submodules
    sub.input_layernorm = RMSNormStandIn
    sub.pre_mlp_layernorm = RMSNormStandIn
    attn = sub.self_attention.submodules
    attn.core_attention = FlashAttentionStandIn
    if qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = RMSNormStandIn
    return spec


def block_spec(config, arch, use_moe_spec: bool):
    """The decoder block the rehearsal builds: megatron-core's local spec (per-layer specs for an MoE model) with
    the stand-ins, and the final norm a stand-in too (the local block's ``WrappedTorchNorm`` refuses sequence
    parallelism: megatron-core ``transformer/torch_norm.py``)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if use_moe_spec:
        block = gpt_layer_specs.get_gpt_decoder_block_spec(config, False, normalization="RMSNorm")
        layers = [_swap(s, arch.qk_layernorm) for s in block.layer_specs]
    else:
        local = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_layernorm)
        layer = _swap(local, arch.qk_layernorm)
        layers = [layer] * get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNormStandIn)
