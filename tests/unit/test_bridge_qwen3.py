"""Qwen3 dense through the bridge and the provider (issue 27): the mapping table against transformers' Qwen3ForCausalLM
and megatron-core's GPTModel (q/k norm, no QKV bias, head_dim != hidden / heads, tied and untied), logits equal to
HF's, both conversion tools bit-exact, the published configs, and Qwen3-MoE told apart (its own family).
Multi-process (TP=2 x PP=2) load/export/save and tools/check_logits: tests/dist/test_bridge_dist.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from bridge_helpers import QWEN3_TINY, QWEN3_TINY_TIED, make_hf_model, save_hf
from test_bridge_convert import tensors

from megatron_dapo.bridge.convert import hf_to_megatron, read_meta
from megatron_dapo.bridge.convert_to_hf import megatron_to_hf
from megatron_dapo.config.run_config import ModelConfig, ParallelConfig
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import ArchConfig, compare_arch, load_arch
from megatron_dapo.models.hf_config import arch_from_hf, hf_from_arch
from megatron_dapo.models.mapping import canonical_name, spec_name
from megatron_dapo.models.memory import count_params
from megatron_dapo.models.registry import family_of_hf, table_for

ARCHES = [QWEN3_TINY, QWEN3_TINY_TIED]

# config.json of Qwen/Qwen3-32B (the published model; transformers 4.51 spelling)
QWEN3_32B_HF = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 25600, "max_position_embeddings": 40960,
    "max_window_layers": 64, "model_type": "qwen3", "num_attention_heads": 64, "num_hidden_layers": 64,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 151936,
}  # fmt: skip


@pytest.mark.parametrize("arch", ARCHES, ids=lambda a: a.name)
def test_table_matches_transformers_qwen3(arch):
    model = make_hf_model(arch)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    hf = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    table = table_for(arch).hf_shapes(arch)
    if arch.tie_embeddings:
        assert hf.pop("lm_head.weight") == table["model.embed_tokens.weight"]
    assert table == hf
    assert table["model.layers.0.self_attn.q_norm.weight"] == (arch.head_dim,) != (arch.hidden_size,)
    assert table["model.layers.0.self_attn.q_proj.weight"] == (
        arch.num_attention_heads * arch.head_dim,
        arch.hidden_size,
    )
    assert not any(n.endswith("_proj.bias") for n in table)


@pytest.mark.parametrize("arch", ARCHES, ids=lambda a: a.name)
def test_megatron_model_names_params_and_logits_equal_hf(arch):
    """The local-spec GPTModel has exactly the table's parameters (count = the memory model's), and with the HF weights
    copied in through the table its logits equal transformers' (fp32)."""
    from megatron_dapo.actor.dist import init_distributed, seed_everything
    from megatron_dapo.actor.provider import build_model, model_position_ids

    init_distributed(ParallelConfig())  # as MegatronActor does in-process (no os.environ rendezvous)
    seed_everything(0)
    model_cfg = ModelConfig(dtype="fp32")
    [model] = build_model(arch, model_cfg, ParallelConfig())
    params = dict(model.named_parameters())
    table = table_for(arch)
    assert set(params) == set(table.by_megatron(arch))
    assert sum(p.numel() for p in params.values()) == count_params(arch)
    hf_model = make_hf_model(arch, seed=3)
    padded = params["embedding.word_embeddings.weight"].shape[0]
    full = table.hf_to_megatron(hf_model.state_dict(), arch, padded_vocab=padded)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(full[name])
        ids = torch.randint(0, arch.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
        n = ids.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
        got = model(ids, model_position_ids(torch.arange(n).expand(2, n), model_cfg), mask)[..., : arch.vocab_size]
        want = hf_model(ids).logits
    assert (got - want).abs().max().item() < 1e-5


def test_qk_norm_names_are_the_same_in_both_specs():
    """TE fuses only the pre-attention / pre-MLP norms; q_layernorm / k_layernorm keep their names in the TE spec
    (megatron-core 0.16.1 gpt_layer_specs.py:282-287 and :405-410, SelfAttentionSubmodules in both specs)."""
    for part in ("q_layernorm", "k_layernorm"):
        name = f"decoder.layers.3.self_attention.{part}.weight"
        assert spec_name(name, te=True) == spec_name(name, te=False) == canonical_name(name) == name


def test_provider_asks_both_specs_for_qk_layernorm(monkeypatch):
    """The TE spec cannot be built without TE: the provider's request to it is checked instead."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_dapo.actor import provider

    calls = []
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", lambda **kw: calls.append(kw))
    monkeypatch.setattr(provider, "use_transformer_engine", lambda cfg: True)
    provider.layer_spec(ModelConfig(), qk_layernorm=True)
    assert calls == [{"fp8": None, "qk_layernorm": True}]
    monkeypatch.setattr(provider, "use_transformer_engine", lambda cfg: False)
    spec = provider.layer_spec(ModelConfig(), qk_layernorm=True).submodules.self_attention.submodules
    assert spec.q_layernorm is spec.k_layernorm and spec.q_layernorm.__name__ == "WrappedTorchNorm"


@pytest.mark.parametrize("arch", ARCHES, ids=lambda a: a.name)
def test_conversion_round_trip_is_bit_exact(tmp_path, arch):
    """In process (the tools themselves, at TP=2 x PP=2 through the actor: tests/dist/test_bridge_dist.py)."""
    hf = save_hf(arch, tmp_path / "hf", seed=7, dtype=torch.bfloat16, max_shard_size="40KB")
    hf_to_megatron(hf, tmp_path / "mg", tp=2, pp=2)
    got_arch, _ = read_meta(tmp_path / "mg")
    assert got_arch == dataclasses.replace(arch, name=got_arch.name)
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", hf_template=hf, max_shard_size="30KB")
    orig, back = tensors(hf), tensors(tmp_path / "back")
    if arch.tie_embeddings:
        orig.pop("lm_head.weight", None)
    assert sorted(back) == sorted(orig)
    for k, v in orig.items():
        assert v.dtype == back[k].dtype and torch.equal(v, back[k]), k
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["model_type"], config["head_dim"], config["attention_bias"]) == ("qwen3", arch.head_dim, False)


def test_published_configs_match_the_model_configs():
    arch = arch_from_hf(QWEN3_32B_HF, name="qwen3-32b")
    compare_arch(load_arch("qwen3-32b"), arch, "qwen3-32b")
    assert (arch.head_dim, arch.hidden_size // arch.num_attention_heads, arch.qk_layernorm) == (128, 80, True)
    small = {**QWEN3_32B_HF, "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
             "num_hidden_layers": 28, "tie_word_embeddings": True}  # fmt: skip
    compare_arch(load_arch("qwen3-0.6b"), arch_from_hf(small), "qwen3-0.6b")
    mid = {**QWEN3_32B_HF, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
           "num_hidden_layers": 36}  # fmt: skip
    compare_arch(load_arch("qwen3-8b"), arch_from_hf(mid), "qwen3-8b")
    for name in ("qwen3-0.6b", "qwen3-8b", "qwen3-32b"):  # and back to a config transformers reads
        a = load_arch(name)
        compare_arch(a, arch_from_hf(hf_from_arch(a), name=name), name)


def test_qwen3_moe_is_its_own_family_not_qwen3():
    moe = {**QWEN3_32B_HF, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 128}
    moe.update(moe_intermediate_size=768, num_experts_per_tok=8)
    for cfg in (moe, {**moe, "model_type": None}, {**moe, "architectures": None}):
        assert family_of_hf(cfg).name == "qwen3_moe"  # tests/unit/test_qwen3_moe.py tests the family


def test_qk_layernorm_is_fixed_by_the_family(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nfamily: qwen3\nqkv_bias: false\n")  # qk_layernorm left out
    with pytest.raises(ConfigError, match="qk_layernorm = False: family qwen3 has per-head q/k RMSNorm.*true"):
        load_arch(path)
    with pytest.raises(ConfigError, match="use_sliding_window = true"):
        arch_from_hf({**QWEN3_32B_HF, "use_sliding_window": True})
    with pytest.raises(ConfigError, match="qk_layernorm mismatch"):
        compare_arch(QWEN3_TINY, ArchConfig(**{**QWEN3_TINY.__dict__, "qk_layernorm": False}), "x")


def test_sglang_layout_of_a_qwen3_at_tp2():
    """What the weights checker expects from a TP2 SGLang server (the real one: tests/sglang/test_qwen3.py at TP1):
    q/k norms replicated, q/k/v fused per rank, no bias entries."""
    from megatron_dapo.engines.sglang.layout import ServerChecksums, server_tensor_hash

    arch = QWEN3_TINY
    hf = make_hf_model(arch).state_dict()
    expect = ServerChecksums(torch.float32, "cpu", tp_size=2, head_dim=arch.head_dim)
    for name, t in hf.items():
        expect.add(name, t)
    got = expect.result()
    q_norm = "model.layers.0.self_attn.q_norm.weight"
    assert got[(q_norm, 0)] == got[(q_norm, 1)] == server_tensor_hash(hf[q_norm])
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert got[(qkv, 1)] == server_tensor_hash(torch.cat([q.chunk(2)[1], k.chunk(2)[1], v.chunk(2)[1]]))
    assert not [n for n, _ in got if n.endswith("bias")] and len(got) == 2 * (2 + 8 * arch.num_layers + 1)


def test_local_activations_of_a_qwen3_are_what_autograd_saves():
    """The memory model's q/k-norm term (memory.local_activation_bytes_per_token) against autograd's saved tensors of a
    Qwen3 layer (head_dim 96 != 256 / 4, bf16), as tests/unit/test_memory_measured.py measures the others."""
    from test_memory_measured import PROBE, _worker

    from megatron_dapo.models.memory import local_activation_bytes_per_token

    arch = {**PROBE, "family": "qwen3", "qk_layernorm": True, "kv_channels": 96}
    saved = _worker({"arch": arch, "rows": 8, "len": 128, "prompt": 16, "dtype": "bf16", "saved": True})
    counted = local_activation_bytes_per_token(ArchConfig(**arch), 128, 2)
    assert counted == pytest.approx(saved["saved_bytes_per_layer_token"], rel=0.02)


@pytest.mark.parametrize("model,nodes", [("qwen3-0.6b", 1), ("qwen3-8b", 2), ("qwen3-32b", 16)])
def test_the_planner_fits_each_qwen3(model, nodes):
    from megatron_dapo.planning.planner import plan
    from megatron_dapo.planning.plans import choose

    best = choose(plan(model, max_prompt=2048, max_response=20480, nodes=nodes, gpus_per_node=8, gpu_mem_gb=80))
    assert best.feasible and 8 % best.tp == 0 and best.model == model  # TP within the 8 KV heads
