"""math-verify as a reward backend, run in a process pool with a time limit per call.

    with MathVerifyPool(workers=2, timeout_s=5.0) as pool:
        results = pool.score_batch(["... \\boxed{0.5}"], ["\\frac{1}{2}"])   # [{"score": 1.0, "status": "ok", ...}]

math-verify times itself out with ``signal.alarm``, which only works in a process's main thread, and a stuck C call
(big-integer arithmetic, regex backtracking) ignores signals altogether. So every call runs in a worker process
(spawn or forkserver, never fork: the parent may hold threads and CUDA), in two layers of time limits:

* soft: inside the worker an interval timer raises a ``BaseException`` after ``timeout_s`` (math-verify's own timeouts
  are switched off so the timer is ours and a timeout is told apart from a wrong answer);
* hard: the parent waits at most ``timeout_s + grace_s`` for a call; past that it kills this pool's own worker
  processes, recreates the pool and resubmits the other calls that were in flight.

Either way the call scores -1 and is counted as a timeout; a run never hangs on a pathological answer. A worker that
dies (segfault, OOM kill) breaks the pool: it is recreated and the calls in flight run once more, then score -1 as
errors. As with any spawn/forkserver pool, the workers import the parent's ``__main__``: scripts need the usual
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool

OK, WRONG, INVALID, TIMEOUT, ERROR = "ok", "wrong", "invalid", "timeout", "error"
NO_ANSWER = "[INVALID]"

# A scorer runs in the worker: (response, ground_truth) -> (correct, pred); correct None = no answer found.
ScoreFn = Callable[[str, str], "tuple[bool | None, str]"]


class _SoftTimeout(BaseException):
    """Raised by the worker's interval timer; a BaseException so that math-verify's ``except Exception`` lets it by."""


def math_verify_match(response: str, ground_truth: str) -> tuple[bool | None, str]:
    """Parse the ground truth (as ``\\boxed{gt}``) and the response with math-verify and compare them symbolically."""
    from math_verify import parse, verify

    gold = parse(ground_truth if "\\boxed" in ground_truth else f"\\boxed{{{ground_truth}}}", parsing_timeout=None)
    if not gold:
        gold = parse(ground_truth, parsing_timeout=None)
    pred = parse(response, parsing_timeout=None)
    if not pred:
        return None, NO_ANSWER
    shown = next((p for p in reversed(pred) if isinstance(p, str)), str(pred[0]))
    return bool(verify(gold, pred, timeout_seconds=None)), shown


def _init_worker() -> None:
    """Worker start: import and exercise math-verify once so the first real call is not charged for it."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # silence "timeout is disabled" (the timer is ours)
    try:
        math_verify_match("\\boxed{1}", "1")
    except Exception:  # noqa: BLE001 - a broken install shows up as errors on the real calls
        pass


def _on_alarm(signum, frame):  # noqa: ARG001
    raise _SoftTimeout()


def _run_one(score_fn: ScoreFn, response: str, ground_truth: str, timeout_s: float) -> tuple[str, str]:
    """Worker side of one call: (status, pred) under the soft time limit."""
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        correct, pred = score_fn(response, ground_truth)
        if correct is None:
            return INVALID, pred
        return (OK, pred) if correct else (WRONG, pred)
    except _SoftTimeout:
        return TIMEOUT, NO_ANSWER
    except Exception as e:  # noqa: BLE001 - any parser failure is a -1, counted as an error
        return ERROR, f"{type(e).__name__}: {e}"[:200]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _warmup() -> int:
    time.sleep(0.05)  # long enough that each of the first jobs lands on a different worker
    return os.getpid()


def _result(status: str, pred: str) -> dict:
    correct = status == OK
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred, "status": status}


class MathVerifyPool:
    """A pool of scoring processes with per-call time limits; see the module docstring.

    ``score_fn`` must be a picklable top-level function (tests inject slow ones). Counters (cumulative):
    ``calls``, ``timeouts`` (soft + hard), ``hard_timeouts``, ``errors``, ``invalid``, ``restarts``.
    """

    def __init__(
        self,
        workers: int | None = None,
        timeout_s: float = 5.0,
        grace_s: float | None = None,
        score_fn: ScoreFn = math_verify_match,
        mp_context: str = "spawn",
        startup_timeout_s: float = 300.0,
    ):
        if timeout_s <= 0:
            raise ValueError(f"math-verify timeout_s = {timeout_s}: must be > 0")
        if mp_context == "fork":
            raise ValueError("math-verify pool: mp_context 'fork' is unsafe here (threads, CUDA); use spawn/forkserver")
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self.timeout_s = float(timeout_s)
        self.grace_s = float(grace_s) if grace_s is not None else max(2.0, self.timeout_s)
        self.score_fn = score_fn
        self.startup_timeout_s = startup_timeout_s
        self._ctx = multiprocessing.get_context(mp_context)
        self._pool: cf.ProcessPoolExecutor | None = None
        self.counters = collections.Counter({k: 0 for k in ("calls", "timeouts", "hard_timeouts", "errors", "invalid")})
        self.counters["restarts"] = 0

    # -- pool lifecycle -------------------------------------------------------------------------------------------

    def _ensure_pool(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            pool = cf.ProcessPoolExecutor(self.workers, mp_context=self._ctx, initializer=_init_worker)
            try:
                warm = [pool.submit(_warmup) for _ in range(self.workers)]
                for fut in warm:
                    fut.result(timeout=self.startup_timeout_s)
            except Exception as e:
                self._kill(pool)
                raise RuntimeError(
                    f"math-verify pool: workers did not start within {self.startup_timeout_s:.0f} s: {e!r}"
                ) from e
            self._pool = pool
        return self._pool

    @staticmethod
    def _kill(pool: cf.ProcessPoolExecutor) -> None:
        """Kill this pool's own worker processes (never anything else) and reap them.

        ``_processes`` is private to ``ProcessPoolExecutor`` (public ``kill_workers()`` arrives in Python 3.14)."""
        procs = list((getattr(pool, "_processes", None) or {}).values())
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        pool.shutdown(wait=True, cancel_futures=True)
        for proc in procs:
            proc.join(timeout=5)

    def _restart(self) -> None:
        if self._pool is not None:
            self._kill(self._pool)
            self._pool = None
        self.counters["restarts"] += 1
        self._ensure_pool()

    def worker_pids(self) -> list[int]:
        pool = self._pool
        return sorted(p.pid for p in (getattr(pool, "_processes", None) or {}).values()) if pool else []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> MathVerifyPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- scoring --------------------------------------------------------------------------------------------------

    def score(self, response: str, ground_truth: str) -> dict:
        return self.score_batch([response], [ground_truth])[0]

    def score_batch(self, responses: Sequence[str], ground_truths: Sequence[str]) -> list[dict]:
        """Score each response against its ground truth; result dicts carry score (±1), acc, pred, status."""
        if len(responses) != len(ground_truths):
            raise ValueError(f"score_batch: {len(responses)} responses but {len(ground_truths)} ground truths")
        n = len(responses)
        results: list[dict | None] = [None] * n
        attempts = [0] * n
        pending = collections.deque(range(n))
        inflight: dict[cf.Future, tuple[int, float]] = {}
        hard_limit = self.timeout_s + self.grace_s
        while pending or inflight:
            pool = self._ensure_pool()
            # At most one call per worker in flight, so a call starts when it is submitted and its clock is honest.
            broken = False
            while pending and len(inflight) < self.workers and not broken:
                i = pending.popleft()
                attempts[i] += 1
                try:
                    fut = pool.submit(_run_one, self.score_fn, responses[i], str(ground_truths[i]), self.timeout_s)
                except BrokenProcessPool:  # a worker died while idle
                    attempts[i] -= 1
                    pending.appendleft(i)
                    broken = True
                    continue
                inflight[fut] = (i, time.monotonic())
            if broken:
                self._abandon(inflight, attempts, pending, results, charge=True)
                continue
            first_deadline = min(start for _, start in inflight.values()) + hard_limit
            done, _ = cf.wait(
                inflight, timeout=max(0.0, first_deadline - time.monotonic()), return_when=cf.FIRST_COMPLETED
            )
            for fut in done:
                i, _ = inflight.pop(fut)
                try:
                    results[i] = _result(*fut.result())
                except BrokenProcessPool:  # a worker died (segfault, OOM kill): we cannot tell which call did it
                    broken = True
                    self._retry_or_fail(i, attempts, pending, results)
            now = time.monotonic()
            expired = [f for f, (_, start) in inflight.items() if now - start >= hard_limit]
            for fut in expired:
                i, _ = inflight.pop(fut)
                results[i] = _result(TIMEOUT, NO_ANSWER)
                self.counters["hard_timeouts"] += 1
            if expired or broken:
                # After a hard timeout the others in flight are innocent; after a crash any of them may be guilty.
                self._abandon(inflight, attempts, pending, results, charge=broken)
        for r in results:
            assert r is not None
            self.counters["calls"] += 1
            if r["status"] == TIMEOUT:
                self.counters["timeouts"] += 1
            elif r["status"] == ERROR:
                self.counters["errors"] += 1
            elif r["status"] == INVALID:
                self.counters["invalid"] += 1
        return results  # type: ignore[return-value]

    def _abandon(self, inflight: dict, attempts: list[int], pending: collections.deque, results: list, charge: bool):
        """Restart the pool; the calls in flight run again (``charge``: that counts as one of their two attempts)."""
        for i, _ in inflight.values():
            if not charge:
                attempts[i] -= 1
            self._retry_or_fail(i, attempts, pending, results)
        inflight.clear()
        self._restart()

    @staticmethod
    def _retry_or_fail(i: int, attempts: list[int], pending: collections.deque, results: list) -> None:
        if attempts[i] >= 2:
            results[i] = _result(ERROR, "worker process died")
        else:
            pending.appendleft(i)
