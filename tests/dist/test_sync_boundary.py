"""The weight sync's boundary: while rank 0 waits in ``schedule.before_sync`` for the generation in flight (one_step_off,
async), the other ranks wait on the control plane, not inside the sync's default-group collectives (NCCL on GPU,
parallel.collective_timeout_s: its watchdog kills them). Every schedule, a generation 2.5 times the default group's
timeout (3 s here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
WORKER = Path(__file__).with_name("sync_boundary_worker.py")
MODES = ["one_step_off-false", "async-true", "sync-false", "sync-true"]  # schedule-partial


def test_a_generation_longer_than_the_collective_timeout_drains_before_the_sync(tmp_path):
    run_torchrun(2, WORKER, tmp_path, ",".join(MODES), 3, 7.5, timeout=240)
    recs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in recs:
        assert r["ok"] and r["done"] == MODES, r
    assert recs[1]["seconds"] > 2 * 7.5  # rank 1 waited out both slow generations of the async schedules
