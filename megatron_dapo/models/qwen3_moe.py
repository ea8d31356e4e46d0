"""Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-235B-A22B): the dense family's attention (per-head q/k
RMSNorm, explicit ``head_dim``) with a mixture of SwiGLU experts in place of the MLP on every layer not in ``mlp_only_layers`` (and, with
``decoder_sparse_step`` = s, only on layers i with (i + 1) % s == 0: transformers ``Qwen3MoeDecoderLayer``).

The router (HF ``mlp.gate``, megatron-core ``mlp.router``) scores all experts with a softmax and keeps the top k; with
``norm_topk_prob`` the k probabilities are renormalised, which is a softmax over the k chosen logits: megatron-core's
``moe_router_pre_softmax=False`` (``actor/provider.py``). No shared expert, no router bias.

Checkpoints on disk name each expert: ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`` (transformers 5 fuses
them in memory, ``gate_up_proj`` [E, 2F, H], and writes them back per expert; SGLang 0.5.23's ``Qwen3MoeForCausalLM``
loads per-expert names only: sglang/srt/models/qwen3_moe.py ``load_weights``, ``FusedMoE.make_expert_params_mapping``).
Canonical Megatron names use the global expert index (``decoder.layers.L.mlp.experts.E.linear_fc1.weight``); the model
holds ``mlp.experts.local_experts.j`` with j = E - ep_rank · (experts / EP) (``bridge/reshard.py``)."""

from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.family import Family
from megatron_dapo.models.mapping import (
    AutoMapping,
    MappingTable,
    decoder_mappings,
    expert_width,
    mlp_mappings,
    qk_norm_mappings,
)


def _moe_layer(a, layer: int) -> bool:
    return a.is_moe_layer(layer)


def _dense_layer(a, layer: int) -> bool:
    return not a.is_moe_layer(layer)


def moe_mlp_mappings():
    """Router + routed experts on MoE layers, the dense SwiGLU MLP on the others."""
    return (
        *mlp_mappings(("decoder.layers.*.mlp", "model.layers.*.mlp"), layer_when=_dense_layer),
        AutoMapping(
            "decoder.layers.*.mlp.router.weight",
            "model.layers.*.mlp.gate.weight",
            lambda a: (a.num_experts, a.hidden_size),
            layer_when=_moe_layer,
        ),
        *mlp_mappings(
            ("decoder.layers.*.mlp.experts.#", "model.layers.*.mlp.experts.#"), expert_width, layer_when=_moe_layer
        ),
    )


# ArchConfig field -> config.json key
MOE_FIELDS = {
    "num_experts": "num_experts",  # transformers 5 writes "num_local_experts" (an alias of num_experts)
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "moe_topk": "num_experts_per_tok",
    "moe_norm_topk_prob": "norm_topk_prob",
}


def moe_from_hf(hf_config: dict, source: str) -> dict:
    """The MoE fields of a config.json: experts, widths, top-k, and which layers are MoE
    (transformers ``Qwen3MoeDecoderLayer``: layer i is MoE unless in ``mlp_only_layers`` and when
    (i + 1) % decoder_sparse_step == 0)."""
    cfg = dict(hf_config)
    if "num_experts" not in cfg and "num_local_experts" in cfg:
        cfg["num_experts"] = cfg["num_local_experts"]
    missing = [k for k in MOE_FIELDS.values() if k not in cfg and k != "norm_topk_prob"]
    if missing:
        raise ConfigError(f"{source}: a mixture of experts without {missing}")
    out = {field: cfg[key] for field, key in MOE_FIELDS.items() if key in cfg}
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(cfg["num_hidden_layers"])]
    out["moe_layers"] = None if all(pattern) else pattern
    return out


def moe_to_hf(arch) -> dict:
    out = {key: getattr(arch, field) for field, key in MOE_FIELDS.items()}
    out["decoder_sparse_step"] = 1
    out["mlp_only_layers"] = [i for i, moe in enumerate(arch.moe_layer_pattern()) if not moe]
    return out


FAMILY = Family(
    name="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    hf_model_type="qwen3_moe",
    table=MappingTable("qwen3_moe", decoder_mappings(extra=qk_norm_mappings(), mlp=moe_mlp_mappings())),
    qkv_bias="attention_bias",
    qk_layernorm=True,
    hf_fixed={"hidden_act": "silu", "use_sliding_window": False},
    moe=True,
    extra_from_hf=moe_from_hf,
    extra_to_hf=moe_to_hf,
)
