"""The model families megatron-dapo trains, by name and by Hugging Face architecture.

A family outside this package plugs in by reference: a model config's ``family: "package.module:NAME"`` (a
``models.family.Family``) is imported and registered on first use; it is then also found by its HF architecture."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from megatron_dapo.config.plugins import load_object
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models import llama, qwen2, qwen3, qwen3_moe
from megatron_dapo.models.family import Family
from megatron_dapo.models.mapping import MappingTable

if TYPE_CHECKING:
    from megatron_dapo.models.arch import ArchConfig

FAMILIES: dict[str, Family] = {f.name: f for f in (qwen2.FAMILY, llama.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY)}
DEFAULT_FAMILY = qwen2.FAMILY.name  # an architecture YAML without ``family:``

# Families recognised but not trained, with what is missing (a model config's ``family`` or HF ``model_type``)
UNSUPPORTED: dict[str, str] = {}
UNSUPPORTED_ARCHITECTURES: dict[str, str] = {}


def family_named(name: str, source: str = "model config", key: str = "family") -> Family:
    """The family a model config names: a registered name or ``package.module:NAME``; errors name the key."""
    if name in UNSUPPORTED:
        raise ConfigError(f"{source}: {key} = {name!r}: {UNSUPPORTED[name]}")
    if name in FAMILIES:
        return FAMILIES[name]
    if isinstance(name, str) and ":" in name:
        family = load_object(name, f"{source}: {key}")
        if not isinstance(family, Family):
            raise ConfigError(f"{source}: {key} = {name!r}: a {type(family).__name__}, not a models.family.Family")
        FAMILIES[name] = family  # under the reference the model configs use
        return family
    raise ConfigError(
        f"{source}: {key} = {name!r}: unknown family; known: {', '.join(FAMILIES)} (or 'package.module:NAME')"
    )


def family_of_hf(hf_config: dict, source: str = "config.json") -> Family:
    """The family of an HF ``config.json``, from ``architectures`` / ``model_type`` (never from a model's name)."""
    archs = hf_config.get("architectures") or []
    model_type = hf_config.get("model_type")
    if model_type in UNSUPPORTED:
        raise ConfigError(f"{source}: model_type = {model_type!r}: {UNSUPPORTED[model_type]}")
    for a in archs:
        if a in UNSUPPORTED_ARCHITECTURES:
            raise ConfigError(f"{source}: architectures = {archs}: {UNSUPPORTED[UNSUPPORTED_ARCHITECTURES[a]]}")
    by_arch = [f for f in FAMILIES.values() if any(a in f.hf_architectures for a in archs)]
    by_type = [f for f in FAMILIES.values() if model_type == f.hf_model_type]
    if by_type and by_arch and by_arch[0] is not by_type[0]:  # transformers' AutoConfig goes by model_type
        raise ConfigError(
            f"{source}: model_type = {model_type!r} (family {by_type[0].name}) contradicts "
            f"architectures = {archs} (family {by_arch[0].name})"
        )
    if by_type or by_arch:
        return (by_type or by_arch)[0]
    raise ConfigError(
        f"{source}: architectures={archs} model_type={model_type!r}: unsupported; "
        f"supported: {', '.join(a for f in FAMILIES.values() for a in f.hf_architectures)}"
    )


def table_for(arch_or_family: ArchConfig | str) -> MappingTable:
    name = arch_or_family if isinstance(arch_or_family, str) else arch_or_family.family
    return family_named(name, key="family (bridge mapping table)").table


def iter_hf_names(arch: ArchConfig) -> Iterable[str]:
    return (h for p in table_for(arch).params(arch) for h in p.hf)
