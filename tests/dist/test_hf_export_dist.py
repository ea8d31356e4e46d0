"""The streamed HF export at TP=2 x PP=2 (4 ranks, gloo): rank 0 writes every tensor, in bounded shards, equal to
what the live export gives it; the shard count is the one ``export_plan`` predicts."""

import json
from pathlib import Path

import pytest

from tests.helpers import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def test_tp2_pp2_export_writes_what_rank0_receives(tmp_path):
    run_torchrun(4, Path(__file__).with_name("hf_export_worker.py"), tmp_path, timeout=400)
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["names_equal"] and r["equal"], r
    assert r["files"] == r["planned"] > 1 and r["index"], r
