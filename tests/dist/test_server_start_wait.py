"""Issue 22 #7: outside ``dapo launch`` rank 0 starts its SGLang server in ``RolloutDriver.__init__`` (a health wait of
up to rollout.server_timeout_s) while the other ranks went on to the first export's collective in the default group
(NCCL on GPU: parallel.collective_timeout_s, 10 min), which a slow 32B boot outlasted: its watchdog killed them. They
now wait for the start on the control plane (gloo, rollout.control_timeout_s). Here the default group's timeout is
4 s and the start takes 10 s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
WORKER = Path(__file__).with_name("server_start_worker.py")


def _records(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_server_start_slower_than_the_collective_timeout_keeps_the_peers(tmp_path):
    run_torchrun(2, WORKER, tmp_path, "slow", 4, 10)
    recs = _records(tmp_path)
    assert all(r["ok"] for r in recs), recs
    assert recs[1]["started_s"] > 9.5  # rank 1 left the driver's start only once rank 0's server was up


def test_a_failed_server_start_reaches_every_rank(tmp_path):
    run_torchrun(2, WORKER, tmp_path, "fail", 4, 1)
    recs = _records(tmp_path)
    assert [r["ok"] for r in recs] == [False, False] and all(r["waited_s"] < 4 for r in recs), recs
    assert recs[0]["error"].startswith("RuntimeError: server exited during start-up")
    assert recs[1]["error"] == "DriverError: rank 0: RuntimeError: server exited during start-up; log: server.log"
