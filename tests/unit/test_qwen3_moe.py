"""Qwen3-MoE through the bridge (in one process): the mapping table against transformers' Qwen3MoeForCausalLM (per-expert
names on disk, router, dense layers where mlp_only_layers says), config.json both ways, EP placement of experts, the
offline TP x EP x PP split, the conversion tools bit-exact, megatron-core's MoE model names and logits equal to HF's,
and errors that name the key. Multi-process (TP=2 x EP=2 x PP=2): tests/dist/test_moe_bridge.py."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
from bridge_helpers import make_hf_model, save_hf
from test_bridge_convert import tensors

from megatron_dapo.bridge.convert import hf_to_megatron, read_meta
from megatron_dapo.bridge.convert_to_hf import megatron_to_hf
from megatron_dapo.bridge.reshard import ep_rank_of_expert, gather_model, split_model
from megatron_dapo.config.run_config import ModelConfig, ParallelConfig
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import check_divisible, compare_arch, load_arch
from megatron_dapo.models.hf_config import arch_from_hf, hf_from_arch
from megatron_dapo.models.memory import count_params
from megatron_dapo.models.registry import table_for

TINY = load_arch("tiny-moe")  # 6 experts, top 2, layer 1 dense, untied

# config.json of Qwen/Qwen3-30B-A3B (the published model)
QWEN3_30B_A3B_HF = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip


def test_table_matches_transformers_names_and_shapes_on_disk(tmp_path):
    save_hf(TINY, tmp_path / "hf")
    on_disk = {k: tuple(v.shape) for k, v in tensors(tmp_path / "hf").items()}
    assert table_for(TINY).hf_shapes(TINY) == on_disk
    assert "model.layers.1.mlp.gate_proj.weight" in on_disk and "model.layers.1.mlp.gate.weight" not in on_disk
    assert on_disk["model.layers.0.mlp.experts.5.down_proj.weight"] == (64, 32)


def test_published_configs_and_the_hf_config_both_ways():
    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "tiny-moe"):
        a = load_arch(name)
        compare_arch(a, arch_from_hf(hf_from_arch(a), name=name), name)
    a = arch_from_hf(QWEN3_30B_A3B_HF)
    compare_arch(load_arch("qwen3-30b-a3b"), a, "qwen3-30b-a3b")
    assert a.moe_layers is None and a.num_experts == 128 and a.moe_topk == 8
    # transformers 5 spells the expert count num_local_experts; sparse steps and dense layers select MoE layers
    cfg = {**QWEN3_30B_A3B_HF, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert arch_from_hf(cfg).moe_layers == [0, 1, 0, 0, 0, 1]
    assert hf_from_arch(TINY)["mlp_only_layers"] == [1]


def test_bad_moe_configs_name_the_key(tmp_path):
    def write(extra: str):
        path = tmp_path / "m.yaml"
        base = "name: m\nfamily: qwen3_moe\nqk_layernorm: true\nqkv_bias: false\nnum_layers: 2\n"
        path.write_text(base + extra)
        return path

    cases = {
        "num_experts: 0\n": "num_experts = 0: family qwen3_moe is a mixture of experts",
        "num_experts: 4\nmoe_ffn_hidden_size: 8\nmoe_topk: 5\n": r"moe_topk = 5: must be in \[1, num_experts = 4\]",
        "num_experts: 4\nmoe_ffn_hidden_size: 8\nmoe_topk: 2\nmoe_layers: [1]\n": "moe_layers = .*each of the 2",
        "num_experts: 4\nmoe_topk: 2\n": "moe_ffn_hidden_size = 0: must be >= 1",
    }
    for extra, match in cases.items():
        with pytest.raises(ConfigError, match=match):
            load_arch(write(extra))
    with pytest.raises(ConfigError, match="parallel.ep = 4: must divide the experts of tiny-moe"):
        check_divisible(TINY, 1, 1, prefix="parallel.", ep=4)
    with pytest.raises(ConfigError, match="ep = 2: tiny has no experts"):
        check_divisible(load_arch("tiny"), 1, 1, ep=2)


def test_experts_are_placed_in_consecutive_blocks_per_ep_rank():
    assert [ep_rank_of_expert(e, TINY, 3) for e in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_split_gather_round_trip_all_tp_ep_pp():
    hf = {k: v.detach() for k, v in make_hf_model(TINY, seed=3).state_dict().items()}
    hf = {**hf, **_per_expert(hf)}
    full = table_for(TINY).hf_to_megatron(hf, TINY)
    for tp, ep, pp in itertools.product([1, 2], [1, 2, 3], [1, 2]):
        shards = split_model(full, TINY, tp, pp, ep=ep)
        assert len(shards) == tp * ep * pp
        for (stage, _, _), named in shards.items():
            experts = {n for n in named if ".local_experts." in n}
            # each rank holds experts / ep local experts on each of its MoE layers, and every non-expert weight
            moe_layers = sum(TINY.moe_layer_pattern()[stage * (4 // pp) : (stage + 1) * (4 // pp)])
            assert len(experts) == 2 * (6 // ep) * moe_layers
        back = gather_model(shards, TINY, tp, pp, ep=ep)
        assert sorted(back) == sorted(full)
        for k, v in full.items():
            assert torch.equal(back[k], v), (tp, ep, pp, k)


def _per_expert(sd: dict) -> dict:
    """transformers 5 holds the experts fused in memory (gate_up_proj [E, 2F, H], gate rows first; down_proj
    [E, H, F]); on disk, and in our table, they are per expert."""
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            prefix, half = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = v[e, :half]
                out[f"{prefix}{e}.up_proj.weight"] = v[e, half:]
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[f"{k[: -len('down_proj')]}{e}.down_proj.weight"] = v[e]
    return out


def test_conversion_round_trip_is_bit_exact(tmp_path):
    hf = save_hf(TINY, tmp_path / "hf", seed=7, dtype=torch.bfloat16, max_shard_size="40KB")
    hf_to_megatron(hf, tmp_path / "mg", tp=2, pp=2, ep=2)
    got_arch, meta = read_meta(tmp_path / "mg")
    assert got_arch == dataclasses.replace(TINY, name=got_arch.name) and meta["ep"] == 2
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", hf_template=hf, max_shard_size="30KB")
    orig, back = tensors(hf), tensors(tmp_path / "back")
    assert sorted(back) == sorted(orig)
    for k, v in orig.items():
        assert v.dtype == back[k].dtype and torch.equal(v, back[k]), k
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["mlp_only_layers"]) == ("qwen3_moe", 6, [1])


def test_megatron_moe_model_names_and_logits_equal_hf(tmp_path):
    """megatron-core's MoE GPTModel (local spec, SequentialMLP experts, alltoall dispatcher, CPU shims) loaded from
    the HF weights through the table: every parameter named by the table, logits equal to transformers'."""
    from megatron_dapo.actor.dist import init_distributed, seed_everything
    from megatron_dapo.actor.provider import build_model, model_position_ids
    from megatron_dapo.bridge.load import load_hf_into_model

    init_distributed(ParallelConfig())  # as MegatronActor does in-process
    seed_everything(0)
    model_cfg = ModelConfig(dtype="fp32")
    hf_dir = save_hf(TINY, tmp_path / "hf", seed=5)
    chunks = build_model(TINY, model_cfg, ParallelConfig(), training=False)
    names = {n for n, _ in chunks[0].named_parameters()}
    assert len(names) == load_hf_into_model(chunks, TINY, hf_dir)
    assert sum(p.numel() for p in chunks[0].parameters()) == count_params(TINY)  # the memory model's count
    assert "decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight" in names
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names  # the dense layer
    ids = torch.randint(0, TINY.vocab_size, (1, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(13, 13, dtype=torch.bool), 1)[None, None]
    pos = model_position_ids(torch.arange(13)[None], model_cfg)
    with torch.no_grad():
        ours = chunks[0].eval()(ids, pos, mask)[0, :, : TINY.vocab_size]
        ref = make_hf_model(TINY, seed=5)(ids).logits[0]
    assert (ours - ref).abs().max() < 1e-4


def test_sglang_servers_return_routes_for_replay_and_refuse_dense_layers():
    """A server for an MoE run asks SGLang for its routes (replayed, or with replay off compared); SGLang 0.5.23 builds every Qwen3-MoE
    layer sparse, so an architecture with a dense layer is refused with the SGLang engine, naming model.arch."""
    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.engines.sglang.server import server_args

    assert "--enable-return-routed-experts" in server_args(load_config("demo_cpu_sglang", ["model.arch=tiny-moe-all"]))
    off = load_config("demo_cpu_sglang", ["model.arch=tiny-moe-all", "rollout.routing_replay=false"])
    assert "--enable-return-routed-experts" in server_args(off)  # replay off: still compared (routing/agreement)
    assert "--enable-return-routed-experts" not in server_args(load_config("demo_cpu_sglang"))  # dense
    with pytest.raises(ConfigError, match=r"model.arch = 'tiny-moe'.*layers \[1\] are dense"):
        server_args(load_config("demo_cpu_sglang", ["model.arch=tiny-moe"]))


def test_routing_replay_refuses_what_it_cannot_replay_up_front():
    """Replay with context parallelism, or through a rollout function (its samples carry no routes yet), is a
    ConfigError naming the key before anything is built, never a silent fallback to the trainer's own routing."""
    from megatron_dapo.actor.routes import check_replay
    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.config.typed_yaml import ConfigError

    check_replay(load_config("demo_moe_cpu_sglang"))
    with pytest.raises(ConfigError, match="rollout.routing_replay with rollout.generate"):
        check_replay(
            load_config("demo_moe_cpu_sglang", ["rollout.generate=megatron_dapo.rollouts.single_turn:generate"])
        )
