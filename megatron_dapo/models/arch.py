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
    # Mixture of experts (num_experts = 0: dense). ffn_hidden_size stays the width of the dense layers' MLP.
    num_experts: int = 0  # routed experts per MoE layer (HF num_experts)
    moe_ffn_hidden_size: int = 0  # one expert's FFN width (HF moe_intermediate_size)
    moe_topk: int = 0  # experts per token (HF num_experts_per_tok)
    moe_norm_topk_prob: bool = True  # the top-k probabilities renormalised to sum to 1 (HF norm_topk_prob)
    moe_layers: list[int] | None = None  # per layer: 1 MoE, 0 dense MLP; None: every layer is MoE

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and (self.moe_layers is None or bool(self.moe_layers[layer]))

    def moe_layer_pattern(self) -> list[int]:
        """1 for an MoE layer, 0 for a dense one, per layer (megatron-core ``moe_layer_freq`` as a list)."""
        return [int(self.is_moe_layer(i)) for i in range(self.num_layers)]


def routing_replay_enabled(setting: bool | None, arch: ArchConfig) -> bool:
    """``rollout.routing_replay`` for this architecture: None = on for a mixture of experts; on for a dense model is
    an error naming the key."""
    if setting and not arch.is_moe:
        raise ConfigError(f"rollout.routing_replay = true: {arch.name} has no experts to route (a dense model)")
    return arch.is_moe if setting is None else bool(setting)


def routes_wanted(setting: bool | None, arch: ArchConfig) -> bool:
    """Whether the rollout engine returns each sample's routed experts: for every mixture of experts, replay on or
    off (off, the actor still measures how often it routes as the engine did: ``routing/agreement``)."""
    routing_replay_enabled(setting, arch)  # a dense model with replay on is an error
    return arch.is_moe


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
    validate_moe(a, bad)
    want = family_named(a.family, source).qk_layernorm
    if a.qk_layernorm != want:
        what = "has per-head q/k RMSNorm (q_norm, k_norm)" if want else "has no q/k norm"
        raise bad("qk_layernorm", f"family {a.family} {what}: set qk_layernorm: {str(want).lower()}")


def validate_moe(a: ArchConfig, bad) -> None:
    family_moe = family_named(a.family).moe
    if a.num_experts < 0:
        raise bad("num_experts", "must be >= 0 (0: a dense model)")
    if bool(a.num_experts) != family_moe:
        need = "a mixture of experts: set num_experts" if family_moe else "dense: set num_experts: 0"
        raise bad("num_experts", f"family {a.family} is {need}")
    if not a.is_moe:
        return
    if a.moe_ffn_hidden_size < 1:
        raise bad("moe_ffn_hidden_size", "must be >= 1 (one expert's FFN width)")
    if not 1 <= a.moe_topk <= a.num_experts:
        raise bad("moe_topk", f"must be in [1, num_experts = {a.num_experts}]")
    if a.moe_layers is not None:
        if len(a.moe_layers) != a.num_layers or any(x not in (0, 1) for x in a.moe_layers):
            raise bad("moe_layers", f"must list 0 (dense) or 1 (MoE) for each of the {a.num_layers} layers")
        if not any(a.moe_layers):
            raise bad("moe_layers", "has no MoE layer: set num_experts: 0 for a dense model")


_MOE_FIELDS = ("num_experts", "moe_ffn_hidden_size", "moe_topk", "moe_norm_topk_prob")
_ARCH_FLOATS = ("rope_theta", "norm_eps")


def compare_arch(expected: ArchConfig, actual: ArchConfig, source: str) -> None:
    """Raise naming the first field where two architectures differ (layers, hidden, heads, KV groups, vocab, tie, bias,
    q/k norm, head dim, RoPE base, norm epsilon)."""
    fields = ("family", *_ARCH_SIZES, "tie_embeddings", "qkv_bias", "qk_layernorm", "head_dim", *_ARCH_FLOATS)
    if expected.is_moe or actual.is_moe:
        fields += _MOE_FIELDS
    for name in fields:
        a, b = getattr(expected, name), getattr(actual, name)
        if name in ("ffn_hidden_size",) and expected.is_moe and all(expected.moe_layer_pattern()):
            continue  # no dense layer: the dense width is unused (and HF configs carry an arbitrary one)
        if isinstance(a, float) or isinstance(b, float):  # e.g. rms_norm_eps stored as float32 (9.9999997e-06)
            if not math.isclose(float(a), float(b), rel_tol=1e-6):
                raise ConfigError(f"{source}: {name} mismatch: model config has {a!r}, checkpoint has {b!r}")
        elif a != b:
            raise ConfigError(f"{source}: {name} mismatch: model config has {a!r}, checkpoint has {b!r}")
    if expected.is_moe and expected.moe_layer_pattern() != actual.moe_layer_pattern():
        raise ConfigError(
            f"{source}: moe_layers mismatch: model config has {expected.moe_layer_pattern()}, "
            f"checkpoint has {actual.moe_layer_pattern()}"
        )


def check_divisible(arch: ArchConfig, tp: int, pp: int, prefix: str = "", ep: int = 1) -> None:
    """The TP/PP/EP sizes ``arch`` can be split into (megatron-core splits the KV groups, the FFN widths, the layers
    and the experts evenly); the message names the size, as ``{prefix}tp`` (``prefix="parallel."`` for a run
    configuration). Experts are split over TP as well (expert tensor parallelism = TP)."""
    if tp < 1 or pp < 1 or ep < 1:
        raise ConfigError(f"{prefix}tp = {tp}, {prefix}pp = {pp}, {prefix}ep = {ep}: must be >= 1")
    if ep > 1 and not arch.is_moe:
        raise ConfigError(f"{prefix}ep = {ep}: {arch.name} has no experts (expert parallelism needs an MoE model)")
    if arch.is_moe and arch.num_experts % ep:
        raise ConfigError(f"{prefix}ep = {ep}: must divide the experts of {arch.name} ({arch.num_experts})")
    if arch.is_moe and arch.moe_ffn_hidden_size % tp:
        raise ConfigError(
            f"{prefix}tp = {tp}: must divide moe_ffn_hidden_size of {arch.name} ({arch.moe_ffn_hidden_size})"
        )
    if arch.num_query_groups % tp:
        raise ConfigError(f"{prefix}tp = {tp}: must divide the KV groups of {arch.name} ({arch.num_query_groups})")
    if arch.ffn_hidden_size % tp:
        raise ConfigError(f"{prefix}tp = {tp}: must divide ffn_hidden_size of {arch.name} ({arch.ffn_hidden_size})")
    if arch.num_layers % pp:
        raise ConfigError(f"{prefix}pp = {pp}: must divide the layers of {arch.name} ({arch.num_layers})")
