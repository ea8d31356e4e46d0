"""Declarative mappings and offline TP/PP resharding, against independently written references."""

from __future__ import annotations

import itertools

import pytest
import torch
from bridge_helpers import LLAMA_TINY, QWEN2_TINY, make_hf_model

from megatron_dapo.bridge.reshard import (
    gather_model,
    global_layer,
    merge_tp,
    padded_vocab_size,
    split_model,
    split_tp,
    stage_of_layer,
)
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.hf_config import hf_from_arch
from megatron_dapo.models.mapping import canonical_name, checkpoint_key, spec_name
from megatron_dapo.models.registry import family_of_hf, table_for


@pytest.fixture(scope="module", params=[QWEN2_TINY, LLAMA_TINY], ids=lambda a: a.name)
def model(request):
    arch = request.param
    return arch, {k: v.clone() for k, v in make_hf_model(arch, seed=3).state_dict().items()}


def reference_qkv(q, k, v, nq, nkv, hd):
    """Megatron's fused QKV written directly: per KV group, its query heads, then k_g, then v_g."""
    rest = q.shape[1:]
    qg = q.reshape(nkv, nq // nkv, hd, *rest)
    return torch.cat([qg, k.reshape(nkv, 1, hd, *rest), v.reshape(nkv, 1, hd, *rest)], 1).reshape(-1, *rest)


def test_tables_are_selected_by_config_family():
    for arch in (QWEN2_TINY, LLAMA_TINY):
        cfg = hf_from_arch(arch)
        assert family_of_hf(cfg).name == arch.family
    with pytest.raises(ConfigError, match="MistralForCausalLM"):
        family_of_hf({"architectures": ["MistralForCausalLM"], "model_type": "mistral"})


def test_hf_to_megatron_layout_matches_reference(model):
    arch, hf = model
    full = table_for(arch).hf_to_megatron(hf, arch)
    nq, nkv, hd = arch.num_attention_heads, arch.num_query_groups, arch.head_dim
    for i in range(arch.num_layers):
        a = f"model.layers.{i}.self_attn"
        qkv = reference_qkv(hf[f"{a}.q_proj.weight"], hf[f"{a}.k_proj.weight"], hf[f"{a}.v_proj.weight"], nq, nkv, hd)
        assert torch.equal(full[f"decoder.layers.{i}.self_attention.linear_qkv.weight"], qkv)
        if arch.qkv_bias:
            b = reference_qkv(hf[f"{a}.q_proj.bias"], hf[f"{a}.k_proj.bias"], hf[f"{a}.v_proj.bias"], nq, nkv, hd)
            assert torch.equal(full[f"decoder.layers.{i}.self_attention.linear_qkv.bias"], b)
        else:
            assert f"decoder.layers.{i}.self_attention.linear_qkv.bias" not in full
        m = f"model.layers.{i}.mlp"
        fc1 = torch.cat([hf[f"{m}.gate_proj.weight"], hf[f"{m}.up_proj.weight"]])
        assert torch.equal(full[f"decoder.layers.{i}.mlp.linear_fc1.weight"], fc1)
        assert torch.equal(full[f"decoder.layers.{i}.mlp.linear_fc2.weight"], hf[f"{m}.down_proj.weight"])
        assert torch.equal(
            full[f"decoder.layers.{i}.pre_mlp_layernorm.weight"],
            hf[f"model.layers.{i}.post_attention_layernorm.weight"],
        )
    assert ("output_layer.weight" in full) == (not arch.tie_embeddings)
    assert torch.equal(full["decoder.final_layernorm.weight"], hf["model.norm.weight"])


def test_hf_megatron_hf_round_trip_is_exact(model):
    arch, hf = model
    table = table_for(arch)
    back = table.megatron_to_hf(table.hf_to_megatron(hf, arch), arch)
    expected = {k: v for k, v in hf.items() if not (arch.tie_embeddings and k == "lm_head.weight")}
    assert sorted(back) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(back[k], v), k


def test_vocab_padding_is_zero_and_stripped(model):
    arch, hf = model
    p = table_for(arch).by_megatron(arch)["embedding.word_embeddings.weight"]
    padded = p.to_megatron([hf["model.embed_tokens.weight"]], padded_vocab=512)
    assert padded.shape[0] == 512 and not padded[arch.vocab_size :].any()
    assert torch.equal(p.to_hf(padded)[0], hf["model.embed_tokens.weight"])


@pytest.mark.parametrize("tp", [1, 2])
def test_tp_shards_follow_megatron_layout(model, tp):
    arch, hf = model
    table = table_for(arch)
    full = table.hf_to_megatron(hf, arch)
    by = table.by_megatron(arch)
    ffn, g = arch.ffn_hidden_size // tp, arch.num_query_groups // tp
    rows_per_group = (arch.num_attention_heads // arch.num_query_groups + 2) * arch.head_dim
    for r in range(tp):
        fc1 = split_tp(
            by["decoder.layers.0.mlp.linear_fc1.weight"], full["decoder.layers.0.mlp.linear_fc1.weight"], tp
        )[r]
        gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
        assert torch.equal(fc1, torch.cat([gate[r * ffn : (r + 1) * ffn], up[r * ffn : (r + 1) * ffn]]))
        qkv_full = full["decoder.layers.0.self_attention.linear_qkv.weight"]
        qkv = split_tp(by["decoder.layers.0.self_attention.linear_qkv.weight"], qkv_full, tp)[r]
        assert torch.equal(qkv, qkv_full[r * g * rows_per_group : (r + 1) * g * rows_per_group])
        proj = split_tp(
            by["decoder.layers.0.self_attention.linear_proj.weight"], hf["model.layers.0.self_attn.o_proj.weight"], tp
        )[r]
        assert proj.shape == (arch.hidden_size, arch.num_attention_heads * arch.head_dim // tp)
        emb = split_tp(by["embedding.word_embeddings.weight"], full["embedding.word_embeddings.weight"], tp)[r]
        assert emb.shape[0] == padded_vocab_size(arch.vocab_size, tp) // tp
        norm = split_tp(
            by["decoder.layers.0.input_layernorm.weight"], full["decoder.layers.0.input_layernorm.weight"], tp
        )[r]
        assert torch.equal(norm, hf["model.layers.0.input_layernorm.weight"])
    for name, p in by.items():
        assert torch.equal(merge_tp(p, split_tp(p, full[name], tp)), full[name]), name


def test_split_gather_round_trip_all_tp_pp(model):
    arch, hf = model
    full = table_for(arch).hf_to_megatron(hf, arch)
    for tp, pp, te in itertools.product([1, 2], [1, 2, 4], [False, True]):
        if arch.num_layers % pp:
            continue
        shards = split_model(full, arch, tp, pp, te=te)
        assert len(shards) == tp * pp
        per_stage = arch.num_layers // pp
        for (stage, _, _), named in shards.items():
            layers = {int(n.split(".")[2]) for n in named if n.startswith("decoder.layers.")}
            assert layers == set(range(per_stage))
            assert ("embedding.word_embeddings.weight" in named) == (stage == 0)
            has_output = "output_layer.weight" in named
            assert has_output == (stage == pp - 1 and (not arch.tie_embeddings or pp > 1))
            assert any("layer_norm_weight" in n for n in named) == te
        back = gather_model(shards, arch, tp, pp)
        assert sorted(back) == sorted(full)
        for k, v in full.items():
            assert torch.equal(back[k], v), (tp, pp, k)


def test_gather_rejects_a_missing_shard(model):
    arch, hf = model
    shards = split_model(table_for(arch).hf_to_megatron(hf, arch), arch, 2, 1)
    del shards[0, 0, 1]["decoder.layers.0.mlp.linear_fc2.weight"]
    with pytest.raises(ConfigError, match="decoder.layers.0.mlp.linear_fc2.weight"):
        gather_model(shards, arch, 2, 1)


def test_stage_assignment_and_names():
    assert [stage_of_layer(i, 8, 4) for i in (0, 1, 2, 7)] == [(0, 0), (0, 1), (1, 0), (3, 1)]
    assert all(global_layer(*stage_of_layer(i, 12, 3), 12, 3) == i for i in range(12))
    te = "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert canonical_name(te) == "decoder.layers.3.input_layernorm.weight"
    assert spec_name("decoder.layers.3.input_layernorm.weight", te=True) == te
    assert (
        spec_name("decoder.layers.3.pre_mlp_layernorm.weight", te=False) == "decoder.layers.3.pre_mlp_layernorm.weight"
    )
    assert checkpoint_key("decoder.layers.5.mlp.linear_fc1.weight") == ("decoder.layers.mlp.linear_fc1.weight", 5)
    assert checkpoint_key("decoder.layers.5.input_layernorm.weight", te=True)[0] == (
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    )
    assert checkpoint_key("embedding.word_embeddings.weight") == ("embedding.word_embeddings.weight", None)
