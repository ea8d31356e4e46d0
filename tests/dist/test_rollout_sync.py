"""HF rollout engine fed by a TP=2 megatron actor: logprob fidelity, and equality with the exported HF checkpoint."""

from pathlib import Path

import pytest
import torch

from tests.helpers import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def test_tp2_sync_fidelity_and_export_equivalence(tmp_path):
    out = tmp_path / "r.pt"
    run_torchrun(2, Path(__file__).with_name("rollout_sync_worker.py"), out, tmp_path / "hf")
    r = torch.load(out)
    assert r["gap_mean"] <= 1e-4 and r["gap_max"] <= 1e-3, r
    assert r["greedy_equal"] and r["sampled_equal"], r
    assert r["greedy_lp_gap"] == 0.0 and r["sampled_lp_gap"] == 0.0, r
