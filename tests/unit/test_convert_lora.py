"""``bridge/convert_lora.py`` without a model: PEFT tensors ⇄ megatron adapters, the merge in HF names, and the PEFT
settings a fused megatron layer cannot take. (The conversions of a real checkpoint: ``tests/dist/test_lora_dist.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_dapo.bridge.convert_lora import _targets_of, megatron_adapters, merged, peft_tensors
from megatron_dapo.bridge.peft import adapted_params
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import load_arch

ARCH = load_arch("tiny")
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LORA = {"rank": 4, "alpha": 8.0, "targets": TARGETS}


def random_adapters(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for p in adapted_params(ARCH, TARGETS):
        rows, cols = p.shape()
        out[p.megatron] = (torch.randn(4, cols, generator=g), torch.randn(rows, 4, generator=g))
    return out


def test_peft_tensors_and_back_are_the_same_adapters():
    adapters = random_adapters()
    params = {p.megatron: p for p in adapted_params(ARCH, TARGETS)}
    tensors = peft_tensors(adapters, params)
    assert "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight" in tensors
    assert "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight" in tensors
    back = megatron_adapters(ARCH, LORA, tensors, Path("peft"))
    assert set(back) == set(adapters)
    for name, (a, b) in adapters.items():
        assert torch.equal(back[name][0], a) and torch.equal(back[name][1], b), name


def test_the_merge_in_hf_names_is_the_merged_weight_split_as_the_bridge_splits_it():
    """``merged`` adds each HF module's rows of B A: the same as splitting W + s B A (the fused QKV by KV group, gate /
    up halves), which is what the live actor's export does."""
    adapters = random_adapters(1)
    for p in adapted_params(ARCH, TARGETS)[:4]:
        a, b = adapters[p.megatron]
        w = torch.randn(p.shape())
        want = p.to_hf(w + 2.0 * b @ a)
        got = merged(p, p.to_hf(w), a, b, 2.0)
        assert len(got) == len(p.hf)
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(got, want)), p.megatron


def test_a_fused_layer_needs_one_a_for_all_its_hf_modules():
    params = {p.megatron: p for p in adapted_params(ARCH, TARGETS)}
    tensors = peft_tensors(random_adapters(), params)
    key = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
    tensors[key] = tensors[key] + 1.0  # as PEFT initializes q_proj, k_proj and v_proj: each its own A
    with pytest.raises(ConfigError, match=r"k_proj.lora_A.weight differs from .*q_proj.lora_A.weight"):
        megatron_adapters(ARCH, LORA, tensors, Path("peft"))


def test_peft_targets_map_to_fused_layers_all_or_none():
    assert _targets_of(ARCH, ["q_proj", "k_proj", "v_proj", "o_proj"], Path("x")) == ["linear_qkv", "linear_proj"]
    with pytest.raises(ConfigError, match=r"adapt \['q_proj', 'v_proj'\] but not \['k_proj'\]"):
        _targets_of(ARCH, ["q_proj", "v_proj"], Path("x"))
    with pytest.raises(ConfigError, match="embed_tokens"):
        _targets_of(ARCH, ["embed_tokens", "q_proj", "k_proj", "v_proj"], Path("x"))


def test_a_wrong_rank_is_named():
    params = {p.megatron: p for p in adapted_params(ARCH, TARGETS)}
    tensors = peft_tensors(random_adapters(), params)
    with pytest.raises(ConfigError, match="rank 8 on this model needs"):
        megatron_adapters(ARCH, {**LORA, "rank": 8}, tensors, Path("peft"))
