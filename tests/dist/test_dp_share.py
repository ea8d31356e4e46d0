"""Issue 14: each data-parallel rank receives only its share of the batch, and trains exactly as on the whole batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]
WORKER = Path(__file__).with_name("dp_share_worker.py")


def test_dp_ranks_receive_their_share_and_train_the_same(tmp_path):
    runs = {}
    for mode in ("whole", "share"):
        (tmp_path / mode).mkdir()
        run_torchrun(2, WORKER, tmp_path / mode, mode)
        runs[mode] = [json.loads((tmp_path / mode / f"rank{r}.json").read_text()) for r in range(2)]
    for r in range(2):
        whole, share = runs["whole"][r], runs["share"][r]
        assert share["extra"] == {"note": "rank 0's"} and share["n"] == 32
        assert share["metrics"] == whole["metrics"] and whole["moved"] > 0
        same = [torch.equal(a, b) for a, b in zip(*(torch.load(tmp_path / m / f"params{r}.pt") for m in runs))]
        assert all(same), f"rank {r}: parameters differ from the whole-batch step"  # bit for bit
    assert runs["share"][0]["remote"] == 0  # rank 0 generated the batch: it holds all of it
    worker = runs["share"][1]
    assert 0 < worker["remote"] < 32 and worker["pickled"] < 0.8 * worker["pickled_whole"], worker
