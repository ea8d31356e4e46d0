"""Per-node weight sync (sync/per_node.py) on 3 ranks: each engine updated by its own poster only, every rank
learns every outcome, and a failure on one node raises on every rank without leaving a collective half done."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
WORKER = Path(__file__).with_name("node_sync_worker.py")


def _records(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]


def test_each_engine_gets_the_whole_export_from_its_own_poster(tmp_path):
    run_torchrun(3, WORKER, tmp_path, -1)
    recs = _records(tmp_path)
    assert [r["received"] for r in recs] == [["w0", "w1", "w2", "w3"], None, ["w0", "w1", "w2", "w3"]]
    routes = [{"rank": 0, "node": "n1", "url": "http://engine0"}, {"rank": 2, "node": "n2", "url": "http://engine1"}]
    assert all(r["routes"] == routes for r in recs)
    assert all(r["metrics"]["sync/engines"] == 2 and r["metrics"]["sync/version"] == 3 for r in recs)
    assert all(r["after"] == 3 for r in recs)


def test_a_failed_engine_raises_on_every_rank_naming_it(tmp_path):
    run_torchrun(3, WORKER, tmp_path, 2)
    recs = _records(tmp_path)
    for r in recs:
        assert "rank 2 (n2) -> http://engine1: RuntimeError: http://engine1 refused bucket 1" in r["error"], r
    assert recs[0]["received"] == ["w0", "w1", "w2", "w3"] and recs[2]["received"] == ["w0"]
    assert all(r["after"] == 3 for r in recs), "a rank was left inside the export's collectives"


def test_a_transport_that_cannot_start_stops_every_rank(tmp_path):
    run_torchrun(3, WORKER, tmp_path, 2, "init")
    for r in _records(tmp_path):
        assert "cannot start: rank 2 (n2) -> http://engine1: ValueError: cannot reach http://engine1" in r["error"], r
        assert r["after"] == 3
