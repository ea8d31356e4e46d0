"""Qwen3 dense (``Qwen3ForCausalLM``): the shared decoder plus per-head RMSNorm on q and k (``q_norm``, ``k_norm``);
``head_dim`` is explicit (128 on every size, not hidden / heads on 0.6B and 32B: ``ArchConfig.kv_channels``); QKV bias
when ``attention_bias`` is set (never in the published models); no sliding window in training.

SGLang serves it in its own fused layout (sglang/srt/models/qwen3.py ``Qwen3Attention``): ``q_norm`` / ``k_norm`` are
plain ``RMSNorm(head_dim)`` weights replicated on every rank (``engines/sglang/layout.py`` keeps them whole)."""

from megatron_dapo.models.family import Family
from megatron_dapo.models.mapping import AutoMapping, Mapping, MappingTable, decoder_mappings, head_shape


def qk_norm_mappings() -> tuple[Mapping, ...]:
    """Per-head RMSNorm on q and k: one [head_dim] weight each, shared by all heads, replicated over TP.
    megatron-core ``qk_layernorm=True`` builds ``self_attention.q_layernorm`` / ``k_layernorm`` with the same names in
    the TE spec (TENorm) and the local spec (WrappedTorchNorm) (megatron-core 0.16.1 models/gpt/gpt_layer_specs.py,
    ``SelfAttentionSubmodules(q_layernorm=..., k_layernorm=...)`` in both ``get_gpt_layer_*_spec``)."""
    attn = "model.layers.*.self_attn"
    return (
        AutoMapping("decoder.layers.*.self_attention.q_layernorm.weight", f"{attn}.q_norm.weight", head_shape),
        AutoMapping("decoder.layers.*.self_attention.k_layernorm.weight", f"{attn}.k_norm.weight", head_shape),
    )


FAMILY = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_type="qwen3",
    table=MappingTable("qwen3", decoder_mappings(extra=qk_norm_mappings())),
    qkv_bias="attention_bias",
    qk_layernorm=True,
    hf_fixed={"hidden_act": "silu", "use_sliding_window": False},
)
