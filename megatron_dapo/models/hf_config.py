"""ArchConfig ⇄ Hugging Face ``config.json``: one table of field names; what differs by family is in its ``Family``."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import ArchConfig, compare_arch
from megatron_dapo.models.registry import family_named, family_of_hf

# ArchConfig field -> HF config.json key (every family's)
FIELDS = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
}


def arch_from_hf(hf_config: dict, name: str = "hf", source: str = "config.json") -> ArchConfig:
    family = family_of_hf(hf_config, source)
    missing = [k for k in FIELDS.values() if k not in hf_config and k not in ("tie_word_embeddings", "rope_theta")]
    if missing:
        raise ConfigError(f"{source}: missing keys {missing}")
    kwargs = {field: hf_config[key] for field, key in FIELDS.items() if key in hf_config}
    # transformers >= 5 nests RoPE settings in "rope_parameters" (4.x: top-level rope_theta + "rope_scaling").
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    if "rope_theta" not in hf_config and "rope_theta" in rope:
        kwargs["rope_theta"] = rope["rope_theta"]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ConfigError(f"{source}: rope type {rope_type!r}: only plain RoPE ('default') is supported")
    kwargs.setdefault("num_query_groups", hf_config["num_attention_heads"])
    head_dim = hf_config.get("head_dim")
    if head_dim and head_dim != hf_config["hidden_size"] // hf_config["num_attention_heads"]:
        kwargs["kv_channels"] = head_dim
    if hf_config.get("use_sliding_window"):
        raise ConfigError(f"{source}: use_sliding_window = true: only full attention is supported")
    if family.extra_from_hf is not None:
        kwargs.update(family.extra_from_hf(hf_config, source))
    bias = family.qkv_bias
    qkv_bias = bias if isinstance(bias, bool) else bool(hf_config.get(bias, False))
    return ArchConfig(name=name, family=family.name, qkv_bias=qkv_bias, qk_layernorm=family.qk_layernorm, **kwargs)


def hf_from_arch(arch: ArchConfig, dtype: str = "float32") -> dict:
    family = family_named(arch.family)
    cfg = {"architectures": list(family.hf_architectures), "model_type": family.hf_model_type, **family.hf_fixed}
    cfg.update({key: getattr(arch, field) for field, key in FIELDS.items()})
    cfg["head_dim"] = arch.head_dim
    if isinstance(family.qkv_bias, str):
        cfg[family.qkv_bias] = arch.qkv_bias
    if family.extra_to_hf is not None:
        cfg.update(family.extra_to_hf(arch))
    cfg["torch_dtype"] = dtype
    return cfg


def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{hf_dir}: no config.json (is this a Hugging Face checkpoint directory?)")
    return json.loads(path.read_text())


def check_hf_dir(arch: ArchConfig, hf_dir: str | Path, key: str = "model.hf_init") -> None:
    """Raise before any compute when the HF checkpoint in ``hf_dir`` is not of architecture ``arch``."""
    hf_arch = arch_from_hf(read_hf_config(hf_dir), source=f"{key} = {hf_dir}: config.json")
    compare_arch(arch, hf_arch, f"{key} = {hf_dir}: config.json vs model.arch = {arch.name}")


def transformers_config(arch: ArchConfig, dtype: str = "float32"):
    """A ``transformers`` config object for the architecture (no hub access)."""
    from transformers import AutoConfig

    cfg = hf_from_arch(arch, dtype)
    model_type = cfg.pop("model_type")
    return AutoConfig.for_model(model_type, **cfg)
