"""Qwen3 dense (``Qwen3ForCausalLM``): the shared decoder plus per-head RMSNorm on q and k (``q_norm``, ``k_norm``);
``head_dim`` is explicit (128 on every size, not hidden / heads on 0.6B and 32B: ``ArchConfig.kv_channels``); QKV bias
when ``attention_bias`` is set (never in the published models); no sliding window in training.

SGLang serves it in its own fused layout (sglang/srt/models/qwen3.py ``Qwen3Attention``): ``q_norm`` / ``k_norm`` are
plain ``RMSNorm(head_dim)`` weights replicated on every rank (``engines/sglang/layout.py`` keeps them whole)."""

from megatron_dapo.models.family import Family
from megatron_dapo.models.mapping import MappingTable, decoder_mappings, qk_norm_mappings

FAMILY = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_type="qwen3",
    table=MappingTable("qwen3", decoder_mappings(extra=qk_norm_mappings())),
    qkv_bias="attention_bias",
    qk_layernorm=True,
    hf_fixed={"hidden_act": "silu", "use_sliding_window": False},
)
