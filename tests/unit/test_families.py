"""A model family lives in one file: its name appears in ``models/<family>.py`` and ``models/registry.py`` and in no
other module of the package (comments included); a family outside the package plugs in as ``package.module:NAME``."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

import megatron_dapo
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import load_arch
from megatron_dapo.models.hf_config import arch_from_hf, hf_from_arch
from megatron_dapo.models.registry import FAMILIES, UNSUPPORTED, family_named, table_for

PACKAGE = Path(megatron_dapo.__file__).parent
BUILTIN = [name for name in FAMILIES if ":" not in name]


def mentions(text: str, family: str) -> list[str]:
    """Lines naming the family as a word; model names with a size after it (``qwen2.5-32b``, ``qwen3-8b``) and the
    mixture-of-experts family of the same name (``Qwen3-MoE``, its own family) are not."""
    pattern = re.compile(rf"\b{re.escape(family)}\b(?![.\-]\d|-moe)", re.IGNORECASE)
    return [line.strip() for line in text.splitlines() if pattern.search(line)]


def test_a_family_is_named_only_in_its_own_file_and_the_registry():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for family in BUILTIN:
            if rel in (f"models/{family}.py", "models/registry.py"):
                continue
            if rel.startswith("engines/") and rel.endswith("/limits.py"):
                continue  # what an engine cannot serve of a family is the engine's knowledge (its own model support)
            if lines := mentions(path.read_text(), family):
                found[f"{rel} ({family})"] = lines[:3]
    assert found == {}


def test_the_scan_sees_a_planted_mention():
    assert mentions("x = 1  # as Qwen3's q_norm does", "qwen3") == ["x = 1  # as Qwen3's q_norm does"]
    assert mentions('load_arch("qwen3-8b"); load_arch("qwen2.5-7b")', "qwen3") == []
    assert mentions("Qwen3-MoE (Qwen3MoeForCausalLM), family qwen3_moe", "qwen3") == []


def test_every_family_round_trips_its_hf_config():
    for name in BUILTIN:
        arch = load_arch("tiny")
        arch.family, arch.qk_layernorm = name, FAMILIES[name].qk_layernorm
        back = arch_from_hf(hf_from_arch(arch), name=arch.name)
        assert (back.family, back.qk_layernorm, back.qkv_bias) == (name, arch.qk_layernorm, arch.qkv_bias)


def test_unknown_and_unsupported_families_name_the_key(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"family = 'mistral': unknown family; known: "):
        family_named("mistral")
    monkeypatch.setitem(UNSUPPORTED, "mamba2", "Mamba-2 is not supported: it has no attention layers")
    bad = tmp_path / "ssm.yaml"
    bad.write_text("name: ssm\nfamily: mamba2\n")
    with pytest.raises(ConfigError, match=r"ssm.yaml: family = 'mamba2': Mamba-2 is not supported"):
        load_arch(bad)


def test_a_family_outside_the_package_plugs_in_by_reference(tmp_path, monkeypatch):
    pkg = tmp_path / "my_families.py"
    pkg.write_text(
        textwrap.dedent("""
        from megatron_dapo.models.family import Family
        from megatron_dapo.models.mapping import MappingTable, decoder_mappings

        MINE = Family(name="mine", hf_architectures=("MineForCausalLM",), hf_model_type="mine",
                      table=MappingTable("mine", decoder_mappings()), qkv_bias="attention_bias")
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("megatron_dapo.models.registry.FAMILIES", dict(FAMILIES))
    arch_file = tmp_path / "mine-tiny.yaml"
    tiny = (PACKAGE.parent / "model_configs" / "tiny.yaml").read_text()
    arch_file.write_text(re.sub(r"(?m)^family: .*$", "family: my_families:MINE", tiny))
    arch = load_arch(arch_file)
    assert arch.family == "my_families:MINE" and table_for(arch).family == "mine"
    assert hf_from_arch(arch)["architectures"] == ["MineForCausalLM"]
    with pytest.raises(ConfigError, match=r"family = 'my_families:NOPE': 'my_families' has no attribute 'NOPE'"):
        family_named("my_families:NOPE")
    sys.modules.pop("my_families", None)
