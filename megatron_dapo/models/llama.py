"""Llama (``LlamaForCausalLM``; also SmolLM2): the shared decoder, QKV bias when ``attention_bias`` is set.
SGLang serves it as sglang/srt/models/llama.py, in the fused layout of ``engines/sglang/layout.py``."""

from megatron_dapo.models.family import Family
from megatron_dapo.models.mapping import MappingTable, decoder_mappings

FAMILY = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    hf_model_type="llama",
    table=MappingTable("llama", decoder_mappings()),
    qkv_bias="attention_bias",
    hf_fixed={"hidden_act": "silu", "mlp_bias": False},
)
