"""`dapo launch --recipe dapo_qwen3_30b_a3b --dry-run --nodes 4 model.hf_init=DIR` (no Slurm needed): the MoE recipe
(its layout is what slurm/dapo_qwen3_30b_a3b.sbatch submits) is predicted to fit, and every SGLang server it would start
returns its routed experts (routing replay is on by default for a mixture of experts; off, the actor still compares
its own routing with the engine's)."""

from __future__ import annotations

import json

import pytest

from megatron_dapo.config.run_config import load_config
from tests.slurm.test_launch_qwen3 import dapo_launch

# config.json of Qwen/Qwen3-30B-A3B-Base (the fields dapo reads)
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                 "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                 "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "attention_bias": False, "num_experts": 128,
                 "moe_intermediate_size": 768, "num_experts_per_tok": 8, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu"}  # fmt: skip


def test_the_recipe_is_dapo_on_qwen3_30b_a3b_with_replay_on():
    cfg = load_config("dapo_qwen3_30b_a3b")
    assert cfg.model.arch == "qwen3-30b-a3b" and cfg.rollout.routing_replay is None and cfg.parallel.cp == 1
    assert cfg.algo.eps_high == 0.28 and cfg.algo.dynamic_sampling  # the paper's DAPO settings (dapo_32b)
    p = cfg.parallel  # the layout the sbatch submits (the planner's: TP4 x PP8, no EP, full recompute, FP8)
    assert (p.tp, p.pp, p.cp, p.ep, cfg.model.recompute, cfg.model.fp8) == (4, 8, 1, 1, "full", "e4m3")
    assert (cfg.rollout.sglang.tp, cfg.rollout.mem_fraction) == (4, 0.61)  # the largest whose start-up phase fits


@pytest.mark.timeout(120)
def test_dry_run_fits_and_every_server_returns_its_routes(tmp_path):
    hf = tmp_path / "Qwen3-30B-A3B-Base"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    args = ["--recipe", "dapo_qwen3_30b_a3b", "--dry-run", "--nodes", "4", f"model.hf_init={hf}"]
    out = dapo_launch(*args)
    assert out.returncode == 0, out.stderr
    servers = [line for line in out.stdout.splitlines() if "sglang.launch_server" in line]
    assert len(servers) == 8 and all("--enable-return-routed-experts" in line for line in servers)
    phases = json.loads(dapo_launch(*args, "--json").stdout)["memory"]["phases"]
    assert all(ph["peak_gib"] < 80 * 0.95 for ph in phases.values()), phases
    off = dapo_launch(*args, "rollout.routing_replay=false")  # still returned: the actor compares its own routing
    assert off.returncode == 0 and "--enable-return-routed-experts" in off.stdout
