"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): the shared decoder, QKV bias always on.
SGLang serves it as sglang/srt/models/qwen2.py, in the fused layout of ``engines/sglang/layout.py``."""

from megatron_dapo.models.family import Family
from megatron_dapo.models.mapping import MappingTable, decoder_mappings

FAMILY = Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    hf_model_type="qwen2",
    table=MappingTable("qwen2", decoder_mappings()),
    qkv_bias=True,
    hf_fixed={"hidden_act": "silu"},
)
