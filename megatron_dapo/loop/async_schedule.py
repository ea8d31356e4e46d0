"""One-step-off and bounded-staleness async rollout: a producer thread on rank 0 generates the next batches while the
trainer trains (``rollout.schedule: one_step_off | async``).

    schedule = make_schedule(cfg, engine, prompts, sampler, scorer)
    seqs, (metrics, stats) = schedule.next_batch(step)   # the batch made for this step; the producer runs on
    ...train...
    schedule.before_sync()                    # every rank: rank 0's producer ends its batch, the others wait (gloo)
    driver.sync_weights(actor, version=step); schedule.weights_updated(step)
    extra = schedule.state_dict()             # batches made but not trained, carried samples, the prompt cursor

The producer drives an inner ``SyncSchedule`` (or ``PartialSchedule``, ``rollout.partial``), one batch at a time, in
step order. It starts the batch for step t on the weights the engines hold, v, only while t − 1 − v <= depth
(one_step_off: 1, async: ``rollout.max_staleness``): the trainer trains step t from version t − 1, so no batch is
trained more than ``depth`` versions after the weights it was generated on. one_step_off is async with depth 1: step
k+1's batch is generated on v_{k−1} while step k trains. Carried partial samples hold older tokens too: a group whose
oldest token is more than ``rollout.partial_max_age`` versions behind the engines' is dropped, and counted, as in
sync mode. Every token is tagged with its lag behind the trainer (``Group.token_lag``), which per-token TIS
(``algo.tis: auto``) weighs.

Weights change only between batches: ``before_sync`` waits for the batch in progress (its surplus aborted at its cut:
dropped, or carried by partial rollout and resumed on the new weights), so a batch's fresh tokens share one version;
one_step_off's also waits for the batch it runs ahead (made on the same weights whatever the timing: reproducible),
async's lets the producer get as far ahead as the timing allows (up to its bound).
The producer resumes at the next ``next_batch``, not at ``weights_updated``: eval and save, which use the engine and
this state, never run beside it. ``state_dict`` holds the finished, untrained batches with the prompt cursor, so a
resume neither loses a prompt nor trains one twice.

Engines: SGLang (HTTP to server processes) generates beside training; the HF engine generates in this thread on its
own copy of the weights (torch releases the GIL in its kernels), sharing the trainer's CPU cores.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass

from megatron_dapo.algo.batch import Group, to_sequences
from megatron_dapo.algo.offpolicy import version_lag_stats
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.loop.control import on_driver


@dataclass
class ReadyBatch:
    """A batch the producer finished: for ``step``, generated on ``version`` (fresh tokens)."""

    step: int
    version: int
    groups: list[Group]
    stats: dict
    metrics: dict


class AsyncSchedule:
    """The producer/consumer schedule (one_step_off = depth 1, async = depth ``rollout.max_staleness``)."""

    def __init__(self, cfg, inner):
        """``inner``: the ``SyncSchedule`` / ``PartialSchedule`` that collects one batch (``make_schedule``)."""
        self.cfg, self.inner = cfg, inner
        self.engine, self.prompts, self.sampler = inner.engine, inner.prompts, inner.sampler
        self.depth = 1 if cfg.rollout.schedule == "one_step_off" else cfg.rollout.max_staleness
        self.strict = cfg.rollout.schedule == "one_step_off"  # the boundary waits for the batch ahead (before_sync)
        self.groups: list[Group] = []  # the last batch's groups (rank 0)
        self.version = 0  # the weights the engines hold
        self.ready: deque[ReadyBatch] = deque()
        self.next_step: int | None = None  # the step the producer makes a batch for next
        self._cond = threading.Condition()
        self._paused, self._busy, self._closed = True, False, False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._idle_since = time.monotonic()

    # -- the loop's calls -------------------------------------------------------------------------------------------
    def next_batch(self, step: int) -> tuple[list, tuple[dict, dict]]:
        """Rank 0: the batch made for ``step`` (waiting for it if need be); the producer may then run ahead."""
        with self._cond:
            if self.next_step is None:
                self.next_step = step
            if self._thread is None:
                self._thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)
                self._idle_since = time.monotonic()
                self._thread.start()
            self._paused = False
            self._cond.notify_all()
            while not self.ready and self._error is None:
                self._cond.wait()
            self._raise()
            batch = self.ready.popleft()
        if batch.step != step:
            raise RuntimeError(f"the producer made its next batch for step {batch.step}, the trainer is at step {step}")
        self.groups = batch.groups
        seqs, metrics = to_sequences(batch.groups, self.cfg)
        metrics.update(batch.metrics)
        metrics["time/batches_ahead"] = float(len(self.ready))  # made ahead, beyond this one (timing: async)
        return seqs, (metrics, batch.stats)

    def before_sync(self) -> None:
        """The boundary, on every rank: the engines go idle for the weight sync. Rank 0 waits for its producer while
        the other ranks wait on the control plane (gloo, ``rollout.control_timeout_s``), not in the sync's collectives
        on the default group (NCCL on GPU: ``parallel.collective_timeout_s``, whose watchdog kills a rank that waits
        longer than a generation may take); a producer error reaches every rank."""
        on_driver(self._drain)

    def _drain(self) -> None:
        """Rank 0: one_step_off first waits until the producer has made the batch it may make on these weights (step
        k+1's on v_{k-1}, whatever the timing: reproducible); async waits only for the batch in progress (how far
        ahead it got, up to its bound, depends on the timing)."""
        with self._cond:
            if self.strict and self._thread is not None and not self._paused:
                while self._error is None and (self._busy or self._may_start()):
                    self._cond.wait()
        self._pause()

    def _pause(self) -> None:
        with self._cond:
            self._paused = True
            while self._busy:
                self._cond.wait()
            self._raise()

    def weights_updated(self, version: int) -> None:
        self._pause()  # never moves the version under a batch in progress (the loop called before_sync already)
        with self._cond:
            self.version = int(version)
            self.inner.weights_updated(version)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            idle = not self._busy
        if self._thread is not None and idle:
            self._thread.join(timeout=10)

    # -- the producer -----------------------------------------------------------------------------------------------
    def _may_start(self) -> bool:
        step = self.next_step
        return step is not None and step <= self.cfg.train.steps and step - 1 - self.version <= self.depth

    def _produce(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._paused or not self._may_start()):
                    self._cond.wait()
                if self._closed:
                    return
                step, version, self._busy = self.next_step, self.version, True
            try:
                batch = self._collect(step, version)
            except BaseException as e:  # noqa: BLE001 (handed to the trainer's thread, raised there)
                with self._cond:
                    self._error, self._busy = e, False
                    self._cond.notify_all()
                return
            with self._cond:
                self.ready.append(batch)
                self.next_step, self._busy = step + 1, False
                self._idle_since = time.monotonic()
                self._cond.notify_all()

    def _collect(self, step: int, version: int) -> ReadyBatch:
        """One batch on the engines' weights (``version``), its tokens tagged with their lag behind the trainer's
        weights when it trains (version ``step`` − 1)."""
        idle = time.monotonic() - self._idle_since
        groups, stats = self.inner.collect_groups(step)
        self.inner.groups = groups
        metrics = self.inner.batch_metrics()  # partial: carried, resumed, dropped (its lag stats replaced below)
        shift = step - 1 - version
        for g in groups:
            g.token_lag = (
                [[lag + shift for lag in row] for row in g.token_lag]
                if g.token_lag
                else [[shift] * len(r) for r in g.responses]
            )
        lags = [row for g in groups for row in g.token_lag]
        metrics.update({f"rollout/{k}": float(v) for k, v in version_lag_stats(lags).items()})
        metrics["rollout/batch_lag"] = float(shift)  # trainer version − the version the batch started on
        metrics["time/engine_idle_s"] = idle  # the producer waited this long (staleness bound, sync) before it
        return ReadyBatch(step, version, groups, stats, metrics)

    def _raise(self) -> None:
        if self._error is not None:  # the producer's own error (its type: RolloutError, BudgetError, ...), raised here
            raise self._error

    # -- resume -----------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The inner schedule's (prompt cursor, sampler, carried samples) and the batches made but not trained."""
        self._pause()
        ready = [{**dataclasses.asdict(b), "groups": [dataclasses.asdict(g) for g in b.groups]} for b in self.ready]
        own = {"kind": self.cfg.rollout.schedule, "depth": self.depth, "next_step": self.next_step, "ready": ready}
        return {**self.inner.state_dict(), "async": own}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict({k: v for k, v in state.items() if k != "async"})
        own = state.get("async") or {"ready": [], "next_step": None}
        self.ready = deque(ReadyBatch(**{**b, "groups": [Group(**g) for g in b["groups"]]}) for b in own["ready"])
        self.next_step = own["next_step"]
        for b in self.ready:
            if b.step - 1 - b.version > self.depth:
                raise ConfigError(
                    f"rollout.schedule = {self.cfg.rollout.schedule!r} (depth {self.depth}): the checkpoint holds the "
                    f"batch for step {b.step}, generated on weights {b.step - 1 - b.version} versions older; resume "
                    f"with the schedule it was saved with ({own.get('kind')!r}, depth {own.get('depth')})"
                )
