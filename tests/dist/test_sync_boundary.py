"""The weight sync's boundary, every schedule: while rank 0 is busy in ``schedule.before_sync`` longer than the default
group's timeout (one_step_off, async: the producer's batch in flight; stream, stream_updates: the lanes' drain after
the abort; sync, partial: rank 0's drain made slow), the other ranks wait on the control plane, not inside the sync's
default-group collectives (NCCL on GPU, parallel.collective_timeout_s: its watchdog kills them). Without the meeting
in before_sync, rank 1 times out in the sync's first gather (sync_boundary_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
WORKER = Path(__file__).with_name("sync_boundary_worker.py")
MODES = ["sync", "partial", "one_step_off", "async", "stream", "stream_updates"]
DEFAULT_TIMEOUT, GEN_S = 2.0, 4.0  # rank 0's busy time at the boundary: twice the default group's timeout


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Per mode, each rank's record. Every mode in one torchrun launch; after a mode that fails, the modes after it
    in a new launch (a timed-out group cannot go on), so each mode's test stands alone."""
    out, left = {}, list(MODES)
    while left:
        folder = tmp_path_factory.mktemp("boundary")
        run_torchrun(2, WORKER, folder, ",".join(left), DEFAULT_TIMEOUT, GEN_S, timeout=240)
        records = [json.loads((folder / f"rank{r}.json").read_text())["modes"] for r in range(2)]
        ran = [m for m in left if any(m in r for r in records)]  # in order, up to the first that failed
        if not ran:
            pytest.fail(f"no mode of {left} ran: {records}")
        for m in ran:
            out[m] = [r.get(m, {"ok": False, "error": "not run on this rank"}) for r in records]
        left = left[len(ran) :]
    return out


@pytest.mark.parametrize("mode", MODES)
def test_rank_0_busy_in_before_sync_past_the_default_timeout_holds_the_others_on_the_control_plane(runs, mode):
    driver, other = runs[mode]
    assert driver["ok"] and other["ok"], f"rank 0: {driver.get('error')}; rank 1: {other.get('error')}"
    assert other["before_sync_s"] > 1.5 * DEFAULT_TIMEOUT  # it waited out rank 0's drain there, not in the sync
