"""Decoder-only architectures (``model_configs/*.yaml``) and the TP/PP splits they allow.

    arch = load_arch("qwen2.5-32b")             # or a path to a YAML file
    check_divisible(arch, tp=8, pp=2, prefix="parallel.")

Errors name the file and the field (``ConfigError``), as the run configuration's do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.config.run_config import resolve_arch_path
from megatron_dapo.config.typed_yaml import ConfigError, from_dict, read_yaml
from megatron_dapo.models.registry import DEFAULT_FAMILY, family_named


@dataclass
class ArchConfig:
    """A decoder-only transformer architecture, in the terms HF config.json and megatron-core share."""

    name: str = "tiny"
    family: str = DEFAULT_FAMILY  # a family in models/registry.py, or "package.module:NAME"
    num_layers: int = 2
    hidden_size: int = 128
    ffn_hidden_size: int = 512
    num_attention_heads: int = 4
    num_query_groups: int = 2  # KV heads (GQA); == num_attention_heads for MHA
    kv_channels: int | None = None  # head dim; default hidden_size // num_attention_heads
    vocab_size: int = 32  # the real vocabulary; the actor pads it for TP
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    qkv_bias: bool = True
    tie_embeddings: bool = True
    qk_layernorm: bool = False  # per-head RMSNorm on q and k before RoPE (HF q_norm / k_norm)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads


def padded_vocab_size(vocab_size: int, tp: int = 1, multiple: int = 128) -> int:
    """Megatron pads the embedding so every TP rank gets an equal slice: round up to a multiple of 128 × TP."""
    step = multiple * tp
    return -(-vocab_size // step) * step


def load_arch(name_or_path: str | Path) -> ArchConfig:
    path = resolve_arch_path(name_or_path)
    data = read_yaml(path)
    if "family" in data:
        family_named(data["family"], str(path))  # unknown or unsupported: named before the fields
    arch = from_dict(ArchConfig, data, str(path))
    validate_arch(arch, str(path))
    return arch


_ARCH_SIZES = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "vocab_size")


def validate_arch(a: ArchConfig, source: str) -> None:
    def bad(key: str, msg: str) -> ConfigError:
        return ConfigError(f"{source}: {key} = {getattr(a, key)!r}: {msg}")

    for key in _ARCH_SIZES:
        if getattr(a, key) < 1:
            raise bad(key, "must be >= 1")
    if a.kv_channels is None and a.hidden_size % a.num_attention_heads:
        raise bad("hidden_size", f"must be divisible by num_attention_heads ({a.num_attention_heads})")
    if a.num_attention_heads % a.num_query_groups:
        raise bad("num_query_groups", f"must divide num_attention_heads ({a.num_attention_heads})")
    want = family_named(a.family, source).qk_layernorm
    if a.qk_layernorm != want:
        what = "has per-head q/k RMSNorm (q_norm, k_norm)" if want else "has no q/k norm"
        raise bad("qk_layernorm", f"family {a.family} {what}: set qk_layernorm: {str(want).lower()}")


_ARCH_FLOATS = ("rope_theta", "norm_eps")


def compare_arch(expected: ArchConfig, actual: ArchConfig, source: str) -> None:
    """Raise naming the first field where two architectures differ (layers, hidden, heads, KV groups, vocab, tie, bias,
    q/k norm, head dim, RoPE base, norm epsilon)."""
    for name in ("family", *_ARCH_SIZES, "tie_embeddings", "qkv_bias", "qk_layernorm", "head_dim", *_ARCH_FLOATS):
        a, b = getattr(expected, name), getattr(actual, name)
        if isinstance(a, float) or isinstance(b, float):  # e.g. rms_norm_eps stored as float32 (9.9999997e-06)
            if not math.isclose(float(a), float(b), rel_tol=1e-6):
                raise ConfigError(f"{source}: {name} mismatch: model config has {a!r}, checkpoint has {b!r}")
        elif a != b:
            raise ConfigError(f"{source}: {name} mismatch: model config has {a!r}, checkpoint has {b!r}")


def check_divisible(arch: ArchConfig, tp: int, pp: int, prefix: str = "") -> None:
    """The TP/PP sizes ``arch`` can be split into (megatron-core splits the KV groups, the FFN width and the layers
    evenly); the message names the size, as ``{prefix}tp`` (``prefix="parallel."`` for a run configuration)."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"{prefix}tp = {tp}, {prefix}pp = {pp}: must be >= 1")
    if arch.num_query_groups % tp:
        raise ConfigError(f"{prefix}tp = {tp}: must divide the KV groups of {arch.name} ({arch.num_query_groups})")
    if arch.ffn_hidden_size % tp:
        raise ConfigError(f"{prefix}tp = {tp}: must divide ffn_hidden_size of {arch.name} ({arch.ffn_hidden_size})")
    if arch.num_layers % pp:
        raise ConfigError(f"{prefix}pp = {pp}: must divide the layers of {arch.name} ({arch.num_layers})")
