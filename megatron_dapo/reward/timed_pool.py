"""Calls that may hang or crash, run in worker processes with a time limit per call.

    with TimedPool(workers=2, timeout_s=5.0) as pool:
        pool.run(fn, [(a1, b1), (a2, b2)])   # [("ok", fn(a1, b1)), ("timeout", None)] in order

A verifier can hang in a C call that ignores signals (big-integer arithmetic, regex backtracking), call
``signal.alarm`` itself, or crash its process. So every call runs in a worker process (spawn or forkserver, never
fork: the parent may hold threads and CUDA), under two time limits:

* soft: inside the worker an interval timer raises a ``BaseException`` after ``timeout_s`` (so a verifier's own
  ``except Exception`` lets it by);
* hard: the parent waits at most ``timeout_s + grace_s`` for a call; past that it kills this pool's own worker
  processes, recreates the pool and resubmits the other calls that were in flight.

A call ends as ``("ok", value)``, ``("timeout", None)`` or ``("error", message)``; a run never hangs on one. A worker
that dies (segfault, OOM kill) breaks the pool: it is recreated and the calls in flight run once more, then end as
errors. ``fn`` and its arguments must be picklable (a top-level function). As with any spawn/forkserver pool, the
workers import the parent's ``__main__``: scripts need the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

OK, TIMEOUT, ERROR = "ok", "timeout", "error"


class _SoftTimeout(BaseException):
    """Raised by the worker's interval timer; a BaseException so that a verifier's ``except Exception`` lets it by."""


def _on_alarm(signum, frame):  # noqa: ARG001
    raise _SoftTimeout()


def _run_one(fn: Callable, args: tuple, timeout_s: float) -> tuple[str, Any]:
    """Worker side of one call, under the soft time limit."""
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return OK, fn(*args)
    except _SoftTimeout:
        return TIMEOUT, None
    except Exception as e:  # noqa: BLE001 - the caller decides what a failed call scores
        return ERROR, f"{type(e).__name__}: {e}"[:500]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _warmup() -> int:
    time.sleep(0.05)  # long enough that each of the first jobs lands on a different worker
    return os.getpid()


class TimedPool:
    """A pool of worker processes with per-call time limits; see the module docstring.

    Counters (cumulative): ``calls``, ``timeouts`` (soft + hard), ``hard_timeouts``, ``errors``, ``restarts``.
    """

    def __init__(
        self,
        workers: int | None = None,
        timeout_s: float = 5.0,
        grace_s: float | None = None,
        mp_context: str = "spawn",
        startup_timeout_s: float = 300.0,
        initializer: Callable[[], None] | None = None,
        name: str = "worker pool",
    ):
        if timeout_s <= 0:
            raise ValueError(f"{name}: timeout_s = {timeout_s}: must be > 0")
        if mp_context == "fork":
            raise ValueError(f"{name}: mp_context 'fork' is unsafe here (threads, CUDA); use spawn/forkserver")
        self.name = name
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self.timeout_s = float(timeout_s)
        self.grace_s = float(grace_s) if grace_s is not None else max(2.0, self.timeout_s)
        self.startup_timeout_s = startup_timeout_s
        self.initializer = initializer
        self._ctx = multiprocessing.get_context(mp_context)
        self._pool: cf.ProcessPoolExecutor | None = None
        self.counters = collections.Counter({k: 0 for k in ("calls", "timeouts", "hard_timeouts", "errors")})
        self.counters["restarts"] = 0

    # -- pool lifecycle -------------------------------------------------------------------------------------------

    def _ensure_pool(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            pool = cf.ProcessPoolExecutor(self.workers, mp_context=self._ctx, initializer=self.initializer)
            try:
                warm = [pool.submit(_warmup) for _ in range(self.workers)]
                for fut in warm:
                    fut.result(timeout=self.startup_timeout_s)
            except Exception as e:
                self._kill(pool)
                raise RuntimeError(
                    f"{self.name}: workers did not start within {self.startup_timeout_s:.0f} s: {e!r}"
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

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- calls ----------------------------------------------------------------------------------------------------

    def run(self, fn: Callable, calls: Sequence[tuple]) -> list[tuple[str, Any]]:
        """``fn(*args)`` for each ``args`` in ``calls``, in worker processes; ``(status, value)`` per call, in order."""
        n = len(calls)
        results: list[tuple[str, Any] | None] = [None] * n
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
                    fut = pool.submit(_run_one, fn, tuple(calls[i]), self.timeout_s)
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
                    results[i] = fut.result()
                except BrokenProcessPool:  # a worker died (segfault, OOM kill): we cannot tell which call did it
                    broken = True
                    self._retry_or_fail(i, attempts, pending, results)
            now = time.monotonic()
            expired = [f for f, (_, start) in inflight.items() if now - start >= hard_limit]
            for fut in expired:
                i, _ = inflight.pop(fut)
                results[i] = (TIMEOUT, None)
                self.counters["hard_timeouts"] += 1
            if expired or broken:
                # After a hard timeout the others in flight are innocent; after a crash any of them may be guilty.
                self._abandon(inflight, attempts, pending, results, charge=broken)
        for r in results:
            assert r is not None
            self.counters["calls"] += 1
            self.counters["timeouts"] += int(r[0] == TIMEOUT)
            self.counters["errors"] += int(r[0] == ERROR)
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
            results[i] = (ERROR, "worker process died")
        else:
            pending.appendleft(i)
