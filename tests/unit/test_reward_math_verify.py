"""math-verify backend: symbolic equivalence in worker processes; bounded time for pathological and hanging calls."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatron_dapo.reward.math_verify_backend import MathVerifyPool

pytestmark = pytest.mark.timeout(180)


# Injected scorers: top-level functions, so the spawned workers can import them from this module.
def hanging_scorer(response: str, ground_truth: str) -> tuple[bool | None, str]:
    """Hangs on "hang" with SIGALRM blocked, like a C call that never returns to the interpreter."""
    if response == "hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    return response == ground_truth, response


def crashing_scorer(response: str, ground_truth: str) -> tuple[bool | None, str]:
    """Kills its own worker process on "crash" (a segfault or OOM kill, as seen by the pool)."""
    if response == "crash":
        os._exit(1)
    return response == ground_truth, response


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def pool():
    with MathVerifyPool(workers=2, timeout_s=1.0, grace_s=3.0) as p:
        yield p


def test_symbolic_equivalence(pool: MathVerifyPool) -> None:
    responses = [
        "So the probability is \\boxed{0.5}.",
        "Answer: 0.5",
        "The result is $\\frac{2}{4}$",
        "Answer: 0.6",
        "I cannot solve this.",
    ]
    results = pool.score_batch(responses, ["\\frac{1}{2}"] * len(responses))
    assert [r["score"] for r in results] == [1.0, 1.0, 1.0, -1.0, -1.0]
    assert [r["status"] for r in results] == ["ok", "ok", "ok", "wrong", "invalid"]
    assert results[0]["acc"] is True and results[3]["acc"] is False


def test_pathological_answer_is_bounded_and_counted_as_timeout(pool: MathVerifyPool) -> None:
    before = pool.counters["timeouts"]
    start = time.monotonic()
    results = pool.score_batch(["\\boxed{9^{9^{9^{9}}}}", "\\boxed{5}"], ["5", "5"])
    elapsed = time.monotonic() - start
    assert results[0]["status"] == "timeout" and results[0]["score"] == -1.0
    assert results[1]["status"] == "ok"  # its neighbour in the batch is unaffected
    assert pool.counters["timeouts"] == before + 1
    assert elapsed < pool.timeout_s + pool.grace_s + 5.0, elapsed


def test_hanging_worker_is_killed_and_replaced_alone() -> None:
    with MathVerifyPool(workers=2, timeout_s=0.5, grace_s=1.0, score_fn=hanging_scorer) as p:
        p._ensure_pool()
        old_pids = p.worker_pids()
        responses = ["1", "hang", "2", "3", "4", "5"]
        truths = ["1", "x", "2", "9", "4", "5"]
        start = time.monotonic()
        results = p.score_batch(responses, truths)
        elapsed = time.monotonic() - start
        assert [r["status"] for r in results] == ["ok", "timeout", "ok", "wrong", "ok", "ok"]
        assert results[1]["score"] == -1.0
        assert p.counters["hard_timeouts"] == 1 and p.counters["timeouts"] == 1 and p.counters["restarts"] == 1
        new_pids = p.worker_pids()
        hung = set(old_pids) - set(new_pids)
        assert len(hung) == 1 and len(new_pids) == 2, (old_pids, new_pids)  # only the hung worker was replaced
        assert not any(_alive(pid) for pid in hung), "the killed worker must be gone"
        # bounded: hard limit + one pool restart (spawn + math-verify import), not the scorer's hour
        assert elapsed < p.timeout_s + p.grace_s + 60, elapsed
        # the recreated pool keeps working
        assert [r["status"] for r in p.score_batch(["7"], ["7"])] == ["ok"]


def test_worker_crash_is_retried_then_scored_as_error() -> None:
    with MathVerifyPool(workers=1, timeout_s=2.0, score_fn=crashing_scorer) as p:
        results = p.score_batch(["1", "crash", "2"], ["1", "1", "3"])
        assert [r["status"] for r in results] == ["ok", "error", "wrong"]
        assert p.counters["errors"] == 1 and p.counters["restarts"] >= 1


def test_worker_killed_while_idle_is_replaced() -> None:
    with MathVerifyPool(workers=2, timeout_s=2.0, score_fn=crashing_scorer) as p:
        p._ensure_pool()
        victim = p.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)  # as the OOM killer would, between two batches
        deadline = time.monotonic() + 10
        while _alive(victim) and time.monotonic() < deadline:
            time.sleep(0.05)
        results = p.score_batch(["1", "2", "3"], ["1", "2", "4"])
        assert [r["status"] for r in results] == ["ok", "ok", "wrong"]
        assert p.counters["restarts"] >= 1 and victim not in p.worker_pids()


def test_mismatched_lengths_and_bad_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        MathVerifyPool(workers=1).score_batch(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="timeout_s"):
        MathVerifyPool(timeout_s=0)
    with pytest.raises(ValueError, match="fork"):
        MathVerifyPool(mp_context="fork")
