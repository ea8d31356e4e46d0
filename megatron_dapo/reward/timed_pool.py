"""Calls that may hang, crash, leak or fork, run in worker processes with a time limit per call.

    with TimedPool(workers=2, timeout_s=5.0) as pool:
        pool.run(fn, [(a1, b1), (a2, b2)])   # [("ok", fn(a1, b1)), ("timeout", None)] in order

A verifier can hang in a C call that ignores signals (big-integer arithmetic, regex backtracking), call
``signal.alarm`` itself, crash its process, leak memory or start processes it never reaps. So every call runs in a
worker process of this pool (spawn or forkserver, never fork: the parent may hold threads and CUDA), one call at a
time per worker, and the parent knows which call each worker runs:

* time: inside the worker an interval timer raises a ``BaseException`` after ``timeout_s`` (so a verifier's own
  ``except Exception`` lets it by); the parent waits at most ``timeout_s + grace_s`` for a call, then kills that
  worker (and its processes) and starts a new one. The other workers' calls go on untouched.
* crash: a worker that dies (segfault, ``os._exit``, OOM kill) fails only the call it was running: that call runs once
  more in a fresh worker, then ends as an error; the calls running beside it are never charged.
* processes: each worker is a child subreaper in a process group of its own; when a call ends, every process it
  started (and their orphans) is stopped and killed. A killed worker's processes are killed with it; a worker that
  died leaves its processes orphaned, and the parent kills its process group (a process that left it with
  ``setsid`` before the worker died escapes that).
* memory: a worker is recycled (exits, a fresh one replaces it) after ``max_tasks`` calls and when its resident memory
  after a call passes ``max_rss_mb``; a spare worker, started ahead, takes its place at once. A call that allocates
  far past the limit within itself is not stopped (no ``RLIMIT_AS``: it would break numpy's and torch's reservations).

A call ends as ``("ok", value)``, ``("timeout", None)`` or ``("error", message)``; a run never hangs on one. ``fn``
and its arguments must be picklable (a top-level function). As with any spawn/forkserver pool, the workers import the
parent's ``__main__``: scripts need the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import logging
import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import signal
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import psutil

OK, TIMEOUT, ERROR = "ok", "timeout", "error"
DEFAULT_MAX_TASKS = 1000  # reward.worker_max_tasks (math-verify at 200: 40% fewer calls/s on 2 cores)
DEFAULT_MAX_RSS_MB = 2048  # reward.worker_max_rss_mb

log = logging.getLogger(__name__)
_PR_SET_CHILD_SUBREAPER = 36


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
    except SystemExit as e:  # sys.exit() in the function ends its call, not the worker
        return ERROR, f"SystemExit: the function called sys.exit({e.code!r})"[:500]
    except Exception as e:  # noqa: BLE001 - the caller decides what a failed call scores
        return ERROR, f"{type(e).__name__}: {e}"[:500]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _become_subreaper() -> bool:
    """Orphans of this process's descendants are re-parented to it (Linux), so a daemonizing child stays findable."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _own_children() -> set[int] | None:
    """This process's children from /proc (a few microseconds, where psutil walks every process); None: unknown."""
    try:
        pids: set[int] = set()
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(p) for p in f.read().split())
        return pids
    except (OSError, ValueError):
        return None


def kill_tree(root: psutil.Process, include_root: bool, keep: frozenset[int] = frozenset()) -> int:
    """Stop, then kill, ``root``'s descendants (not the pids in ``keep``) and with ``include_root`` root itself.

    Each found process is stopped first (SIGSTOP) and the tree walked again, so a fork bomb cannot outrun the walk.
    Returns how many descendants were killed."""
    found: dict[int, psutil.Process] = {}
    if include_root:
        try:
            root.suspend()
        except psutil.Error:
            pass
    for _ in range(100):
        try:
            kids = root.children(recursive=True)
        except psutil.Error:
            kids = []
        new = [p for p in kids if p.pid not in keep and p.pid not in found]
        if not new:
            break
        for p in new:
            found[p.pid] = p
            try:
                p.suspend()
            except psutil.Error:
                pass
    victims = list(found.values()) + ([root] if include_root else [])
    for p in victims:
        try:
            p.kill()
        except psutil.Error:
            pass
    if root.pid == os.getpid():  # our own children (and re-parented orphans): reap them
        psutil.wait_procs(list(found.values()), timeout=5)
    return len(found)


def _worker_main(conn, initializer: Callable[[], None] | None) -> None:
    """A worker: ``(fn, args, timeout_s)`` in, ``((status, value), rss_mb, children_killed)`` out, until ``None``/EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops us through the pipe
    os.setsid()  # a process group of our own: if we die, the parent kills what we started through it
    _become_subreaper()
    try:
        if initializer is not None:
            initializer()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which names the pool
        conn.send(("failed", f"{type(e).__name__}: {e}"[:500]))
        return
    me = psutil.Process()
    keep = frozenset(p.pid for p in me.children(recursive=True))  # the initializer's own helpers, if any
    conn.send(("ready", os.getpid()))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            msg = pickle.loads(data)
        except BaseException as e:  # noqa: BLE001
            result: tuple[str, Any] = (ERROR, f"the call could not be unpickled in the worker: {type(e).__name__}: {e}")
        else:
            if msg is None:
                return
            fn, args, timeout_s = msg
            result = _run_one(fn, args, timeout_s)
        children = _own_children()  # as a subreaper, we have descendants only if we have children
        killed = kill_tree(me, include_root=False, keep=keep) if children is None or children - keep else 0
        rss_mb = me.memory_info().rss / 2**20
        try:
            payload = pickle.dumps((result, rss_mb, killed))
        except BaseException as e:  # noqa: BLE001 - an unpicklable value fails its own call only
            failed = (ERROR, f"the result could not be sent back: {type(e).__name__}: {e}"[:500])
            payload = pickle.dumps((failed, rss_mb, killed))
        conn.send_bytes(payload)


class _Worker:
    """One worker process, its pipe, and the call it runs (``task``: (index, start time)) if any."""

    def __init__(self, ctx, initializer: Callable[[], None] | None, name: str):
        self.conn, child = ctx.Pipe()
        # Not daemonic: a reward function may use multiprocessing itself. close() and the atexit hook stop us.
        self.proc = ctx.Process(target=_worker_main, args=(child, initializer), name=name)
        self.proc.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.tasks = 0
        self.task: tuple[int, float] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid  # type: ignore[return-value]

    def dead(self) -> bool:
        """Whether the process has ended, asked without reaping it (``kill`` needs its pid to name its group)."""
        return bool(mpc.wait([self.proc.sentinel], 0))

    def kill(self) -> None:
        """Kill this worker and every process it started, and reap it."""
        # Not reaped yet, so the pid (and the group it names) is still this worker's. ``Process.exitcode`` would reap it:
        # read the private ``_popen.returncode`` that it sets (multiprocessing's own since Python 3.4).
        if getattr(self.proc._popen, "returncode", None) is None:
            try:
                kill_tree(psutil.Process(self.pid), include_root=True)
            except psutil.Error:
                pass
            try:  # what it started, orphaned when it died (all but those that left its group with setsid)
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        """Ask the worker to exit; kill it if it does not within a few seconds."""
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.proc.join(timeout=5)
        self.kill()


_POOLS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_pools() -> None:  # registered after multiprocessing's own hook, so it runs first (no join on our workers)
    for pool in list(_POOLS):
        pool.close()


class TimedPool:
    """A pool of worker processes with per-call time limits; see the module docstring.

    ``max_tasks``: calls a worker runs before it is recycled (0 = never); ``max_rss_mb``: resident memory after a call
    past which it is recycled (0 = no limit). With either on, one spare worker is kept started, so a recycled worker's
    place is taken at once (no call waits for a process start or the initializer). Counters (cumulative): ``calls``, ``timeouts`` (soft + hard),
    ``hard_timeouts``, ``errors``, ``restarts`` (workers replaced after a death or a hard timeout), ``recycled``
    (workers replaced at their task or memory limit), ``children_killed`` (processes a call left behind).
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
        max_tasks: int = DEFAULT_MAX_TASKS,
        max_rss_mb: float = DEFAULT_MAX_RSS_MB,
    ):
        if timeout_s <= 0:
            raise ValueError(f"{name}: timeout_s = {timeout_s}: must be > 0")
        if mp_context == "fork":
            raise ValueError(f"{name}: mp_context 'fork' is unsafe here (threads, CUDA); use spawn/forkserver")
        if max_tasks < 0 or max_rss_mb < 0:
            raise ValueError(f"{name}: max_tasks = {max_tasks}, max_rss_mb = {max_rss_mb}: must be >= 0 (0 = off)")
        self.name = name
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self.timeout_s = float(timeout_s)
        self.grace_s = float(grace_s) if grace_s is not None else max(2.0, self.timeout_s)
        self.startup_timeout_s = startup_timeout_s
        self.initializer = initializer
        self.max_tasks = int(max_tasks)
        self.max_rss_mb = float(max_rss_mb)
        self._ctx = multiprocessing.get_context(mp_context)
        self._workers: list[_Worker] = []
        self._spare: _Worker | None = None  # with recycling on: one more worker, started, idle, to take a place
        self._retiring: list[tuple[_Worker, float]] = []  # recycled workers on their way out, with a deadline
        self.counters = collections.Counter(
            {k: 0 for k in ("calls", "timeouts", "hard_timeouts", "errors", "restarts", "recycled", "children_killed")}
        )
        _POOLS.add(self)

    # -- workers --------------------------------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self.initializer, f"{self.name} worker")

    def _successor(self) -> _Worker:
        """Who takes a replaced worker's place: the spare, started ahead (a new spare starts), or a new worker."""
        if self._spare is None:
            return self._spawn()
        w, self._spare = self._spare, self._spawn()
        return w

    def _replace(self, w: _Worker, counter: str) -> None:
        """Kill ``w`` (with its processes); its successor takes the place (and calls once it says it is ready)."""
        w.kill()
        self._workers[self._workers.index(w)] = self._successor()
        self.counters[counter] += 1

    def _recycle(self, w: _Worker, why: str) -> None:
        """``w`` exits in the background; its successor takes the place at once."""
        log.info("%s: recycling worker %d: %s", self.name, w.pid, why)
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
        self._retiring.append((w, time.monotonic() + 5.0))
        self._workers[self._workers.index(w)] = self._successor()
        self.counters["recycled"] += 1

    def _reap_retiring(self, wait: bool = False) -> None:
        """Reap the recycled workers that have exited; kill those still there 5 s after they were told to go."""
        keep = []
        for w, deadline in self._retiring:
            if wait:
                w.proc.join(max(0.0, deadline - time.monotonic()))
            if not w.proc.is_alive() or time.monotonic() >= deadline:
                w.kill()
            else:
                keep.append((w, deadline))
        self._retiring = keep

    def _startup_failed(self, why: str) -> None:
        self.close()
        raise RuntimeError(f"{self.name}: workers did not start within {self.startup_timeout_s:.0f} s: {why}")

    def _on_ready(self, w: _Worker) -> None:
        """A starting worker spoke (or died)."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            self._startup_failed(f"worker {w.pid} died while starting (exit code {w.proc.exitcode})")
        if msg[0] != "ready":
            self._startup_failed(f"worker {w.pid}: its initializer raised {msg[1]}")
        w.ready = True

    def _ensure_pool(self) -> TimedPool:
        """``workers`` live workers, all started: dead idle ones replaced (as the OOM killer leaves them)."""
        for w in list(self._workers):
            if w.ready and w.task is None and w.dead():
                self._replace(w, "restarts")
        if self._spare is not None and self._spare.ready and self._spare.dead():
            self._spare.kill()
            self._spare = None
        while len(self._workers) < self.workers:
            self._workers.append(self._spawn())
        if (self.max_tasks or self.max_rss_mb) and self._spare is None:
            self._spare = self._spawn()  # started ahead, so that a recycled worker's place never waits for a start
        deadline = time.monotonic() + self.startup_timeout_s
        while starting := [w for w in self._workers if not w.ready]:
            objs = {w.conn: w for w in starting}
            objs.update({w.proc.sentinel: w for w in starting})
            ready = mpc.wait(list(objs), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._startup_failed("timed out")
            for w in dict.fromkeys(objs[o] for o in ready):
                self._on_ready(w)
        return self

    def worker_pids(self) -> list[int]:
        return sorted(w.pid for w in self._workers)

    def close(self) -> None:
        workers, self._workers = self._workers + ([self._spare] if self._spare else []), []
        self._spare = None
        for w in workers:
            w.stop()
        self._reap_retiring(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- calls ----------------------------------------------------------------------------------------------------

    def run(self, fn: Callable, calls: Sequence[tuple]) -> list[tuple[str, Any]]:
        """``fn(*args)`` for each ``args`` in ``calls``, in worker processes; ``(status, value)`` per call, in order."""
        n = len(calls)
        results: list[tuple[str, Any] | None] = [None] * n
        attempts = [0] * n
        pending = collections.deque(range(n))
        hard_limit = self.timeout_s + self.grace_s
        self._ensure_pool()
        while pending or any(w.task for w in self._workers):
            self._reap_retiring()
            # One call per worker at a time, so a call starts when it is sent and its clock is honest.
            for w in list(self._workers):
                if not (pending and w.ready and w.task is None):
                    continue
                i = pending.popleft()
                try:
                    data = pickle.dumps((fn, tuple(calls[i]), self.timeout_s))
                except Exception as e:  # noqa: BLE001 - this call's arguments, not the pool, are at fault
                    results[i] = (ERROR, f"the call could not be pickled: {type(e).__name__}: {e}"[:500])
                    continue
                try:
                    w.conn.send_bytes(data)
                except OSError:  # the worker died while idle
                    pending.appendleft(i)
                    self._replace(w, "restarts")
                    continue
                attempts[i] += 1
                w.task = (i, time.monotonic())
            watched = [w for w in self._workers if w.task or not w.ready]
            watched += [self._spare] if self._spare is not None and not self._spare.ready else []
            if not watched:
                continue
            deadline = min(
                (w.task[1] + hard_limit) if w.task else (w.started + self.startup_timeout_s) for w in watched
            )
            objs = {w.conn: w for w in watched}
            objs.update({w.proc.sentinel: w for w in watched})
            ready = mpc.wait(list(objs), timeout=max(0.0, deadline - time.monotonic()))
            for w in dict.fromkeys(objs[o] for o in ready):
                if not w.ready:
                    self._on_ready(w)
                else:
                    self._on_reply(w, results, attempts, pending)
            now = time.monotonic()
            for w in self._workers + ([self._spare] if self._spare else []):
                if w.task and now - w.task[1] >= hard_limit:
                    results[w.task[0]] = (TIMEOUT, None)
                    self.counters["hard_timeouts"] += 1
                    self._replace(w, "restarts")  # only this worker: the others' calls go on
                elif not w.ready and now - w.started >= self.startup_timeout_s:
                    self._startup_failed(f"worker {w.pid} timed out")
        for r in results:
            assert r is not None
            self.counters["calls"] += 1
            self.counters["timeouts"] += int(r[0] == TIMEOUT)
            self.counters["errors"] += int(r[0] == ERROR)
        return results  # type: ignore[return-value]

    def _on_reply(self, w: _Worker, results: list, attempts: list[int], pending: collections.deque) -> None:
        """A busy worker answered, or died: the call it ran (and only that call) gets the outcome."""
        data = None
        try:
            if w.conn.poll():
                data = w.conn.recv_bytes()
            elif not w.dead():
                return  # woken by nothing we can read yet
        except (EOFError, OSError):
            pass
        if data is None:  # dead, or its pipe closed (a process it forked may still hold it open: not an EOF then)
            w.kill()
            if w.task is not None:
                i = w.task[0]
                code = w.proc.exitcode
                how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
                if attempts[i] >= 2:
                    results[i] = (ERROR, f"worker process died ({how}), twice on this call")
                else:
                    pending.appendleft(i)  # once more, in a fresh worker: a stray OOM kill is not the call's fault
            self._replace(w, "restarts")
            return
        try:
            reply = pickle.loads(data)
        except Exception as e:  # noqa: BLE001 - a value the trainer cannot unpickle fails its own call
            reply = ((ERROR, f"the result could not be read back: {type(e).__name__}: {e}"[:500]), 0.0, 0)
        (status_value, rss_mb, killed) = reply
        i, _ = w.task  # type: ignore[misc]
        results[i] = status_value
        w.task = None
        w.tasks += 1
        self.counters["children_killed"] += killed
        if self.max_tasks and w.tasks >= self.max_tasks:
            self._recycle(w, f"{w.tasks} calls (max_tasks {self.max_tasks})")
        elif self.max_rss_mb and rss_mb > self.max_rss_mb:
            self._recycle(w, f"resident memory {rss_mb:.0f} MB > max_rss_mb {self.max_rss_mb:g}")
