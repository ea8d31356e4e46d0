"""megatron-core model provider: ``TransformerConfig`` + ``GPTModel`` chunks from an ``ArchConfig``.

GPU with Transformer Engine importable: the TE layer spec (optional FP8, CP, sequence parallel). Otherwise the local
(pure megatron-core) spec, with every fusion that needs TE/apex/CUDA switched off.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch
import torch.nn.functional as F

from megatron_dapo.config.run_config import ModelConfig, ParallelConfig
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import ArchConfig, check_divisible, padded_vocab_size

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# While ``dapo rehearse`` runs a rank's step on a CPU: the block spec that stands in for the TE spec
# (planning/te_standins.py block_spec(config, arch, use_moe_spec)); None everywhere else.
_TE_STAND_IN = None


@contextlib.contextmanager
def te_stand_in(block_spec_fn):
    """Within the block, the actor runs as on Transformer Engine (packed THD micro-batches, sequence parallelism, the
    fused SwiGLU) with ``block_spec_fn``'s modules in TE's places (the rehearsal only)."""
    global _TE_STAND_IN
    saved, _TE_STAND_IN = _TE_STAND_IN, block_spec_fn
    try:
        yield
    finally:
        _TE_STAND_IN = saved


def rehearsing() -> bool:
    """Whether ``dapo rehearse`` runs this actor on a CPU in the GPU job's place (``te_stand_in``)."""
    return _TE_STAND_IN is not None


@functools.cache
def transformer_engine_status() -> tuple[bool, str]:
    """(usable, why not). TE needs CUDA; a half-installed TE raises on import (RuntimeError, OSError, not only
    ImportError), so the import itself is tried, once."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if importlib.util.find_spec("transformer_engine") is None:
        return False, "transformer_engine is not installed"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:
        return False, f"import transformer_engine.pytorch failed: {type(e).__name__}: {e}"
    return True, ""


def have_transformer_engine() -> bool:
    return transformer_engine_status()[0]


def use_transformer_engine(model_cfg: ModelConfig) -> bool:
    """Whether the actor uses the TE layer spec. ``transformer_engine`` without a usable TE is an error naming why;
    ``auto`` uses TE when it works, the local spec on a machine without CUDA, and refuses a GPU whose TE install is
    broken (that fallback would silently trade TE's varlen attention for dense [L, L] attention)."""
    if _TE_STAND_IN is not None:
        return True
    usable, why = transformer_engine_status()
    impl = model_cfg.transformer_impl
    if impl == "transformer_engine" and not usable:
        raise ConfigError(
            f"model.transformer_impl = 'transformer_engine': Transformer Engine is not usable ({why}); install "
            "transformer-engine[pytorch] (requirements/gpu.txt, or run in the image of docker/Dockerfile), or set "
            "model.transformer_impl=local"
        )
    if impl == "auto" and not usable and torch.cuda.is_available() and "failed" in why:
        raise ConfigError(
            f"model.transformer_impl = 'auto': Transformer Engine is installed but broken ({why}); fix the install, "
            "or set model.transformer_impl=local to train with megatron-core's local spec on purpose"
        )
    return impl == "transformer_engine" or (impl == "auto" and usable)


def describe_spec(model_cfg: ModelConfig) -> str:
    """One line saying which layer spec the actor uses and why (printed once at start-up)."""
    usable, why = transformer_engine_status()
    if _TE_STAND_IN is not None:
        return "actor: the rehearsal's stand-ins for Transformer Engine (planning/te_standins.py), packed THD micro-batches"
    if use_transformer_engine(model_cfg):
        fp8 = f", FP8 {model_cfg.fp8} ({model_cfg.fp8_recipe})" if model_cfg.fp8 else ""
        return f"actor: Transformer Engine layer spec, packed THD micro-batches{fp8}"
    reason = "model.transformer_impl=local" if model_cfg.transformer_impl == "local" else why
    warn = (
        " — WARNING: dense attention on a GPU; install transformer-engine for long sequences"
        if torch.cuda.is_available()
        else ""
    )
    return f"actor: megatron-core local layer spec ({reason}), padded [B, L] micro-batches{warn}"


def check_parallel(parallel: ParallelConfig, model_cfg: ModelConfig, arch: ArchConfig, training: bool = True) -> None:
    """Errors for parallel settings this machine or this architecture cannot run (or train), naming the key."""
    te = use_transformer_engine(model_cfg)
    if parallel.cp > 1 and not te:
        raise ConfigError(f"parallel.cp = {parallel.cp}: context parallel needs Transformer Engine attention (GPU)")
    if parallel.sequence_parallel and not te:
        raise ConfigError("parallel.sequence_parallel = true: needs Transformer Engine (GPU)")
    if training and arch.is_moe and parallel.tp > 1 and not parallel.sequence_parallel:
        raise ConfigError(
            f"parallel.tp = {parallel.tp} with a mixture of experts: megatron-core trains MoE layers under TP only with "
            "sequence parallelism (transformer/moe/moe_layer.py MoELayer.forward): set parallel.sequence_parallel=true "
            "(GPU), or split the experts with parallel.ep and keep tp = 1"
        )
    if model_cfg.fp8 and not te:
        raise ConfigError(f"model.fp8 = {model_cfg.fp8!r}: FP8 needs Transformer Engine (GPU)")
    if model_cfg.lora.rank and te and not rehearsing():
        # TE's spec fuses the norm into linear_qkv / linear_fc1 (TELayerNormColumnParallelLinear): the adapter
        # would read the un-normed input. Not supported yet.
        raise ConfigError(
            f"model.lora.rank = {model_cfg.lora.rank} with Transformer Engine: not supported yet (TE fuses the norm "
            "into linear_qkv and linear_fc1, which the adapters must read after it); set model.transformer_impl=local"
        )
    check_divisible(arch, parallel.tp, parallel.pp, prefix="parallel.", ep=parallel.ep)


def transformer_config(
    arch: ArchConfig, model_cfg: ModelConfig, parallel: ParallelConfig, routing_replay: bool = False
):
    from megatron.core.transformer import TransformerConfig

    te = use_transformer_engine(model_cfg)
    dtype = DTYPES[model_cfg.dtype]
    kwargs = {}
    if model_cfg.recompute == "selective":
        kwargs.update(recompute_granularity="selective")
    elif model_cfg.recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if model_cfg.fp8:
        kwargs.update(fp8=model_cfg.fp8, fp8_recipe=model_cfg.fp8_recipe)
    if not te:  # the local spec's RoPE takes explicit positions: see position_embedding_type()
        kwargs.update(mrope_section=[arch.head_dim // 2])
    if arch.is_moe:
        kwargs.update(moe_kwargs(arch, model_cfg, parallel, routing_replay))
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,  # explicit: a family may set head_dim != hidden / heads
        qk_layernorm=arch.qk_layernorm,  # per-head RMSNorm on q and k (the spec builds them: layer_spec)
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Packed micro-batches have varying lengths; PP must exchange shapes (the alltoall dispatcher is required by
        # megatron-core's variable_seq_lengths check even for dense models).
        variable_seq_lengths=parallel.pp > 1,
        moe_token_dispatcher_type="alltoall",
        # Fusions that need TE/apex/CUDA kernels.
        bias_activation_fusion=te,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available() and not rehearsing(),  # the rehearsal: as on GPU
        deallocate_pipeline_outputs=True,
        **kwargs,
    )


def moe_kwargs(
    arch: ArchConfig, model_cfg: ModelConfig, parallel: ParallelConfig, routing_replay: bool = False
) -> dict:
    """megatron-core's MoE settings for an architecture with experts: dropless top-k routing with the router in fp32,
    the alltoall dispatcher (set for every model above), experts as a ``SequentialMLP`` (one SwiGLU MLP per expert:
    the names the bridge maps), MoE and dense layers where ``ArchConfig.moe_layers`` says (always a list: one
    checkpoint key per layer, see ``models.mapping.checkpoint_axes``)."""
    return dict(
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_topk,
        # norm_topk_prob: softmax over the k chosen logits (= renormalised top-k of a full softmax); else softmax first
        moe_router_pre_softmax=not arch.moe_norm_topk_prob,
        moe_layer_freq=arch.moe_layer_pattern(),
        moe_router_load_balancing_type="aux_loss" if model_cfg.moe_aux_loss_coeff else "none",
        moe_aux_loss_coeff=model_cfg.moe_aux_loss_coeff,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.tp,
        moe_enable_routing_replay=routing_replay,  # the routers replay the engine's experts (actor/routes.py)
    )


def layer_spec(model_cfg: ModelConfig, qk_layernorm: bool = False):
    """The layer spec; ``qk_layernorm`` adds ``self_attention.q_layernorm`` / ``k_layernorm`` (TENorm in the TE spec,
    torch RMSNorm in the local one: megatron-core 0.16.1 gpt_layer_specs.py, both ``get_gpt_layer_*_spec``)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_transformer_engine(model_cfg):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(fp8=model_cfg.fp8, qk_layernorm=qk_layernorm)
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)


def position_embedding_type(model_cfg: ModelConfig) -> str:
    """TE: "rope" (packed THD rows restart positions per sequence through cu_seqlens). Local spec: "mrope" fed three
    identical position rows, which is plain RoPE at explicit per-token positions (megatron-core 0.16.1
    models/common/embeddings/rotary_pos_embedding.py:307-360, MultimodalRotaryEmbedding: with equal rows every
    mrope section reads the same positions), so a response can continue the positions of a prompt it shares
    (data/shared_prompt.py). It has no parameters: checkpoints are the same either way."""
    return "rope" if use_transformer_engine(model_cfg) else "mrope"


def model_position_ids(pos: torch.Tensor, model_cfg: ModelConfig) -> torch.Tensor:
    """[b, s] positions in the shape the model's position embedding reads: as is for "rope", three identical rows
    ([3, b, s]) for "mrope" (position_embedding_type above)."""
    return pos if position_embedding_type(model_cfg) == "rope" else pos.expand(3, *pos.shape)


def build_model(
    arch: ArchConfig,
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    training: bool = True,
    routing_replay: bool = False,
) -> list[torch.nn.Module]:
    """The model chunks of this rank (one chunk: no virtual pipeline). ``parallel_state`` must be initialized.
    ``training=False``: a model only run forward in eval mode (``tools/check_logits.py``)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    check_parallel(parallel, model_cfg, arch, training)
    config = transformer_config(arch, model_cfg, parallel, routing_replay)
    if _TE_STAND_IN is not None:
        spec = _TE_STAND_IN(config, arch, arch.is_moe)
    elif arch.is_moe:  # per-layer specs: MoE layers and dense ones (megatron-core models/gpt/gpt_layer_specs.py)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(config, use_transformer_engine(model_cfg), normalization="RMSNorm")
    else:
        spec = layer_spec(model_cfg, arch.qk_layernorm)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, parallel.tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type=position_embedding_type(model_cfg),
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return [model]
