"""Issue 14: no rank waits inside a default-group (NCCL on GPU) collective while rank 0 alone generates or evaluates.
A rollout longer than the default group's collective timeout (5 s here) completes over the control plane, and the
same wait inside the default group times out (so the first result means something)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
WORKER = Path(__file__).with_name("control_plane_worker.py")


def _records(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_rollout_longer_than_the_collective_timeout_completes(tmp_path):
    run_torchrun(2, WORKER, tmp_path, "control", 5, 12)
    recs = _records(tmp_path)
    assert all(r["ok"] for r in recs), recs
    assert recs[0]["result"] == recs[1]["result"] and len(recs[1]["result"]) == 3
    assert recs[1]["waited_s"] > 11  # rank 1 waited the whole rollout, more than twice the 5 s timeout
    assert all(r["phase"] == "rollout" for r in recs)


def test_the_same_wait_inside_the_default_group_times_out(tmp_path):
    run_torchrun(2, WORKER, tmp_path, "default", 5, 12)
    waiting = _records(tmp_path)[1]
    assert not waiting["ok"] and waiting["waited_s"] < 11, waiting
    assert "timed out" in waiting["error"].lower() or "timeout" in waiting["error"].lower(), waiting
