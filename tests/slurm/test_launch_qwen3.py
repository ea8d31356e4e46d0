"""Issue 27: `dapo launch --recipe dapo_qwen3_32b --dry-run --nodes 16 model.hf_init=DIR` (no Slurm needed) prints a
layout predicted to fit: the recipe's, which slurm/dapo_qwen3_32b.sbatch submits as it is (it passes no parallel
sizes of its own: test_sbatch_inputs.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from megatron_dapo.config.run_config import load_config
from tests.helpers import REPO
from tests.slurm.test_launch_plan import NO_SLURM_ENV

# config.json of Qwen/Qwen3-32B (what `dapo train` compares model.arch with; the dry run only needs the directory)
QWEN3_32B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120, "head_dim": 128,
             "intermediate_size": 25600, "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 64,
             "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-06,
             "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False}  # fmt: skip


def dapo_launch(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "launch", *args]
    return subprocess.run(cmd, env=NO_SLURM_ENV, capture_output=True, text=True, cwd=REPO, timeout=120)


def test_recipe_is_dapo_32b_on_qwen3():
    cfg, base = load_config("dapo_qwen3_32b"), load_config("dapo_32b")
    assert cfg.model.arch == "qwen3-32b" and cfg.train.name == "dapo_qwen3_32b"
    assert (cfg.algo, cfg.train.lr, cfg.train.batch_prompts) == (base.algo, base.train.lr, base.train.batch_prompts)


@pytest.mark.timeout(120)
def test_dapo_qwen3_32b_dry_run_prints_a_layout_predicted_to_fit(tmp_path):
    hf = tmp_path / "Qwen3-32B"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(QWEN3_32B))
    args = ["--recipe", "dapo_qwen3_32b", "--dry-run", "--nodes", "16", f"model.hf_init={hf}"]
    out = dapo_launch(*args)
    assert out.returncode == 0, out.stderr
    assert "rollout engines: 32 SGLang servers, TP4 dp 1" in out.stdout and f"--model-path {hf}" in out.stdout
    assert re.search(r"train phase: .* GiB: fits", out.stdout) and re.search(r"rollout phase: .* GiB: fits", out.stdout)
    js = json.loads(dapo_launch(*args, "--json").stdout)  # the recipe's layout: FP8, SP, distributed optimizer
    phases = js["memory"]["phases"]
    assert js["memory"]["fits"] and all(ph["peak_gib"] < 80 * 0.95 for ph in phases.values()), phases
    cfg = load_config("dapo_qwen3_32b")
    assert cfg.model.fp8 == "e4m3" and cfg.parallel.sequence_parallel and cfg.parallel.distributed_optimizer
    assert phases["train"]["peak_gib"] > 60  # the 32B's numbers, not 0.6B's


@pytest.mark.timeout(120)
def test_a_dry_run_refuses_a_checkpoint_of_another_architecture(tmp_path):
    """The launch node reads model.hf_init's config.json as `dapo train` does: a Qwen2.5-32B (or a Qwen3-MoE)
    directory for the Qwen3 recipe is an error in the plan, not at the trainer's start on 16 nodes."""
    for name, config in (("Qwen2.5-32B", {**QWEN3_32B, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                          "attention_bias": True, "head_dim": 80}),
                         ("Qwen3-30B-A3B", {**QWEN3_32B, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                                            "num_experts": 128, "moe_intermediate_size": 768, "num_experts_per_tok": 8}),
                         ("contradicting", {**QWEN3_32B, "model_type": "qwen3_moe"})):  # fmt: skip
        hf = tmp_path / name
        hf.mkdir()
        (hf / "config.json").write_text(json.dumps(config))
        out = dapo_launch("--recipe", "dapo_qwen3_32b", "--dry-run", "--nodes", "16", f"model.hf_init={hf}")
        assert out.returncode == 2 and f"model.hf_init = {hf}: config.json" in out.stderr, (name, out.stderr)
