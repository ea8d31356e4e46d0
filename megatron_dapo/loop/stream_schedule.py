"""A rollout that never drains (``rollout.schedule: stream``): the engines stay full across step boundaries, and the
weight sync interrupts generation instead of waiting for it.

    schedule = make_schedule(cfg, engine, prompts, sampler, scorer)
    seqs, (metrics, stats) = schedule.next_batch(step)   # rank 0: the next B informative groups, in prompt order
    ...train...                                           # the producer keeps generating meanwhile
    schedule.before_sync()                                # every rank: rank 0 aborts what is in flight (no waiting)
    driver.sync_weights(actor, version=step); schedule.weights_updated(step)

The producer keeps a window of admitted groups (prompt order), at most ⌈(1 + ``rollout.stream_staleness``) ×
``algo.gen_batch_prompts``⌉ of them: a step that consumes groups lets as many new prompts in, on whatever weights
the engines hold then. Lanes (``engine.stream_lanes()``: a server engine runs one request per lane, as many lanes as
its servers run at once; the HF engine one lane of batches) take the waiting samples, resumed ones first, and dispatch
them (SGLang: to the least-loaded server). At a sync, rank 0 pauses the lanes and aborts everything in flight: each
sample keeps its tokens, logprobs and the weight version of every token, and after the sync it is resubmitted with
the budget it has left, on the new weights. So the sync never waits for a long generation.

``next_batch`` judges complete groups at the head of the window in prompt order (dynamic sampling stays exact: a
group is judged once all G samples finished, whatever their length; ``rollout.stream_order: completion`` judges every
complete group in the order it completed, as verl, so long groups wait for a later step) until B are kept; the dropped ones are counted,
and nothing taken from the prompts is lost: the window (in-flight samples with their tokens) is checkpointed. Tokens
from older weights than the trainer's are tagged (``Group.token_lag``) for the mismatch correction (``algo.tis:
auto``); a group whose oldest token is more than ``rollout.partial_max_age`` versions behind is dropped, and counted.
The lanes pause from ``before_sync`` to the next ``next_batch``: eval and save use the engine meanwhile.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque

import torch

from megatron_dapo.algo.batch import Group, to_sequences
from megatron_dapo.algo.offpolicy import remaining_budget, version_lag_stats
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.data.dataset import PromptItem
from megatron_dapo.loop.carried import Carried, Slot, carried_group, extend_slot, finish_slot
from megatron_dapo.loop.control import on_driver
from megatron_dapo.loop.rollout_fn import FunctionRollouts
from megatron_dapo.types import GenRequest, SamplingParams, sample_seed


class StreamSchedule:
    def __init__(self, cfg, engine, prompts, sampler, scorer, rollouts=None):
        self.cfg, self.engine, self.prompts, self.sampler, self.scorer = cfg, engine, prompts, sampler, scorer
        # a rollout function (rollout.generate): one sample per lane, resumed mid-turn (loop/rollout_fn.py)
        self.functions = rollouts if isinstance(rollouts, FunctionRollouts) else None
        self._client = None
        self.G, self.max_new = cfg.algo.group_size, cfg.rollout.sampling.max_new_tokens
        self.limit = math.ceil((1 + cfg.rollout.stream_staleness) * cfg.algo.gen_batch_prompts)
        self.groups: list[Group] = []  # the last batch's (rank 0)
        self.version = 0  # the weights the engines hold
        self.window: list[Carried] = []  # admitted groups, prompt order, not yet judged
        self.queue: deque[tuple[Carried, int]] = deque()  # samples waiting for a lane; resumed ones first
        self.totals = {"dropped_stale_groups": 0, "resumed_samples": 0, "interrupted_samples": 0}
        self._cond = threading.Condition()
        self._paused, self._closed, self._busy = True, False, 0
        self._error: BaseException | None = None
        self._lanes: list[threading.Thread] = []
        self._stops = frozenset()
        self._completed_at: dict[int, int] = {}  # id(group) -> when it completed (stream_order: completion)
        self._completions = 0
        # idle accounting between two next_batch returns: the trainer waiting for groups, the lanes all idle
        self._period_start = self._lanes_idle_since = time.monotonic()
        self._lanes_idle_s = self._trainer_wait_s = 0.0

    # -- the loop's calls -------------------------------------------------------------------------------------------
    def next_batch(self, step: int) -> tuple[list, tuple[dict, dict]]:
        """Rank 0: B groups judged in prompt order (dynamic sampling), as training sequences."""
        for _ in self._rounds(step):
            pass
        return self._batch()

    def mini_batches(self, step: int, size: int):
        """Rank 0, ``train.stream_updates``: the step's kept groups as training sequences, ``size`` groups at a time,
        each yielded as soon as its groups are kept (they are the batch's first, second, ... ``size`` groups, as
        ``next_batch`` cuts them); afterwards ``last_batch`` holds what ``next_batch`` would have returned."""
        done = 0
        for _ in self._rounds(step, size):
            kept = self.sampler.kept_groups()
            while len(kept) >= done + size:
                yield to_sequences(kept[done : done + size], self.cfg)[0]
                done += size
        self.last_batch = self._batch()

    def _rounds(self, step: int, mini: int = 0):
        """Rank 0: judge complete groups at the head of the window, a round at a time, until B are kept (``mini``:
        a round waits only for the groups the next mini-batch lacks; algo.max_gen_batches still counts whole rounds'
        worth of groups judged)."""
        self.engine.new_step()
        t0 = time.monotonic()
        self._start()
        self._generated, self._dropped_stale = [], 0
        per_round, judged = min(self.sampler.missing, self.limit), 0  # a whole round's groups (algo.max_gen_batches)
        while not self.sampler.full:
            need = min(self.sampler.missing, self.limit)  # a round: the head of the window (it may be smaller than B)
            if mini:
                need = min(need, mini - len(self.sampler.kept_groups()) % mini)
            with self._cond:
                while self._error is None and len(self._ready()) < need:
                    self._cond.wait(timeout=1.0)
                self._raise()
                take = self._ready()[:need]
                taken = {id(c) for c in take}
                self.window = [c for c in self.window if id(c) not in taken]
                for key in taken:
                    self._completed_at.pop(key, None)
                self._refill()
                self._cond.notify_all()
            fresh, trainer_version = [], step - 1  # step k trains the weights of k - 1 updates
            for c in take:
                oldest = c.oldest_version()
                if oldest is not None and trainer_version - oldest > self.cfg.rollout.partial_max_age:
                    self._dropped_stale += 1
                else:
                    fresh.append(c)
            groups = [carried_group(c, self.scorer, trainer_version) for c in fresh]
            for g in groups:
                self._generated += g.correct
            correct = torch.tensor([g.correct for g in groups], dtype=torch.bool).reshape(len(groups), self.G)
            rounds = (judged + len(take)) // per_round - judged // per_round if mini else 1  # mini: parts of one
            judged += len(take)
            self.sampler.add(groups, correct, rounds)
            self._trainer_wait_s += time.monotonic() - t0
            yield
            t0 = time.monotonic()  # streamed updates ran meanwhile: not waiting

    def _batch(self) -> tuple[list, tuple[dict, dict]]:
        now = time.monotonic()
        self.groups = self.sampler.take()
        seqs, metrics = to_sequences(self.groups, self.cfg)
        metrics.update(self._metrics(now, self._dropped_stale))
        stats = self.sampler.stats()
        stats["kept_groups"] = stats.pop("kept")
        generated = self._generated
        stats["acc_generated"] = sum(generated) / max(1, len(generated))
        stats["samples_generated"] = len(generated)
        stats["server_restarts"] = self.engine.step_restarts
        stats.update(self.scorer.metrics(reset=True))
        if self.functions is not None:
            stats.update(self.functions.metrics(reset=True))  # rollout/<name>: the function's own numbers
        return seqs, (metrics, stats)

    def _ready(self) -> list[Carried]:
        """The groups the next round may judge (caller holds the lock): the complete prefix of the window in prompt
        order, or (``rollout.stream_order: completion``, as verl) every complete group, in the order it completed."""
        if self.cfg.rollout.stream_order == "completion":
            return sorted((c for c in self.window if c.complete), key=lambda c: self._completed_at.get(id(c), 0))
        ready = []
        for c in self.window:
            if not c.complete:
                break
            ready.append(c)
        return ready

    def before_sync(self) -> None:
        """Every rank: rank 0 pauses its lanes and aborts everything in flight; the samples keep what they have."""
        on_driver(self._interrupt)

    def weights_updated(self, version: int) -> None:
        with self._cond:
            self.version = int(version)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._lanes and self.engine is not None:
            self.engine.abort()
        if self._client is not None:
            self.functions.abort()
            self._client.close()
        for t in self._lanes:
            t.join(timeout=30)

    # -- the producer -----------------------------------------------------------------------------------------------
    def _start(self) -> None:
        with self._cond:
            if not self._lanes:
                eos = self.engine.tokenizer.eos_token_ids if self.engine.tokenizer is not None else ()
                self._sampling = SamplingParams.from_config(self.cfg.rollout.sampling, seed=self.cfg.train.seed)
                self._stops = frozenset(eos) | frozenset(self._sampling.stop_token_ids)
                lanes, self._per_call = self.engine.stream_lanes()
                if self.functions is not None:  # each lane runs one sample's function; their calls batch
                    lanes, self._per_call = self.functions.concurrency, 1
                    self._client = self.functions.client(self._sampling)
                self._lanes = [
                    threading.Thread(target=self._lane, name=f"stream-lane-{i}", daemon=True) for i in range(lanes)
                ]
                for t in self._lanes:
                    t.start()
            self._refill()
            if self.functions is not None:
                self.functions.resume_lanes()
            self._paused = False
            self._cond.notify_all()

    def _refill(self) -> None:
        """Admit new prompts (in order) while the window has room: caller holds the lock."""
        while len(self.window) < self.limit:
            (item,) = self.prompts.take(1)
            c = Carried(item, [Slot() for _ in range(self.G)])
            self.window.append(c)
            self.queue.extend((c, j) for j in range(self.G))

    def _request(self, c: Carried, j: int) -> GenRequest:
        slot = c.slots[j]
        seed = sample_seed(self.cfg.train.seed * 7919, c.item.index, j)  # the prompt's place in the data, not timing
        budget = remaining_budget(self.max_new, len(slot.response_ids))
        n = len(slot.response_ids)
        return GenRequest(list(c.item.prompt_ids) + slot.response_ids, budget, seed, route=c.item.index, offset=n)

    def _lane(self) -> None:
        sampling = self._sampling
        while True:
            with self._cond:
                while not self._closed and (self._paused or not self.queue):
                    self._cond.wait()
                if self._closed:
                    return
                work = [self.queue.popleft() for _ in range(min(self._per_call, len(self.queue)))]
                if self._busy == 0:
                    self._lanes_idle_s += time.monotonic() - self._lanes_idle_since
                self._busy += 1
                version = self.version
            unfinished = []
            try:
                if self.functions is not None:
                    unfinished = self._run_function(*work[0], version)
                    continue
                for s in self.engine.generate_requests([self._request(c, j) for c, j in work], sampling):
                    c, j = work[s.prompt_index]
                    with self._cond:
                        had = bool(c.slots[j].response_ids)
                        extend_slot(c.slots[j], s, version, self.max_new, self._stops, self.engine.tokenizer)
                        self._note_completion(c)
                        self.totals["resumed_samples"] += had and bool(s.response_ids)
                        if not c.slots[j].finished:
                            unfinished.append((c, j))
                        self._cond.notify_all()
            except BaseException as e:  # noqa: BLE001 (raised in the trainer's thread by next_batch)
                with self._cond:
                    self._error = e
            finally:
                with self._cond:
                    self.totals["interrupted_samples"] += len(unfinished)
                    self.queue.extendleft(reversed(unfinished))  # resumed first, in their order
                    self._busy -= 1
                    if self._busy == 0:
                        self._lanes_idle_since = time.monotonic()
                    self._cond.notify_all()

    def _run_function(self, c: Carried, j: int, version: int) -> list:
        """A rollout function's sample, resumed from its recorded calls: finished, or back in the queue."""
        slot = c.slots[j]
        had = any(call["response_ids"] for call in slot.calls)
        done = self.functions.run_one(
            self._client, c.item, self._sampling, c.item.index, j, slot.calls, version, self._stops
        )
        with self._cond:
            self.totals["resumed_samples"] += had
            if done is None:
                return [(c, j)]
            finish_slot(slot, *done, self.max_new)
            self._note_completion(c)
            self._cond.notify_all()
        return []

    def _note_completion(self, c: Carried) -> None:
        if c.complete and id(c) not in self._completed_at:
            self._completions += 1
            self._completed_at[id(c)] = self._completions

    def _interrupt(self) -> None:
        """Rank 0: pause the lanes and abort what is in flight, until no call is running (an abort can race a lane's
        call that is just starting: it is aborted again)."""
        with self._cond:
            self._paused = True
            busy = self._busy
        while busy:
            if self.functions is not None:
                self.functions.abort()  # their next client call raises RolloutAborted; what they had is recorded
            else:
                self.engine.abort()
            with self._cond:
                self._cond.wait(timeout=0.05)
                busy = self._busy
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    # -- metrics ----------------------------------------------------------------------------------------------------
    def _metrics(self, now: float, dropped_stale: int) -> dict[str, float]:
        """verl's names where they exist: idle ratios of the trainer and the rollout since the last batch, stale and
        partial samples trained, the largest version span of a trained sample."""
        period = max(1e-9, now - self._period_start)
        with self._cond:
            idle = self._lanes_idle_s + (now - self._lanes_idle_since if self._busy == 0 else 0.0)
            self._lanes_idle_s, self._lanes_idle_since = 0.0, now
            window, waiting = len(self.window), len(self.queue)
        trainer_wait, self._trainer_wait_s, self._period_start = self._trainer_wait_s, 0.0, now
        self.totals["dropped_stale_groups"] += dropped_stale
        lags = [row for g in self.groups for row in g.token_lag]
        spans = [max(row) - min(row) for row in lags if row]
        out = {f"rollout/{k}": float(v) for k, v in version_lag_stats(lags).items()}
        out.update({
            "rollout/trainer_idle_ratio": min(1.0, trainer_wait / period),
            "rollout/rollout_idle_ratio": min(1.0, idle / period),
            "rollout/stale_samples": float(sum(any(row) for row in lags)),
            "rollout/partial_ratio": sum(s > 0 for s in spans) / max(1, len(lags)),
            "rollout/max_partial_span": float(max(spans, default=0)),
            "rollout/dropped_stale_groups": float(dropped_stale),
            "rollout/window_groups": float(window),
            "rollout/waiting_samples": float(waiting),
        })  # fmt: skip
        out.update({f"rollout/{k}_total": float(v) for k, v in self.totals.items()})
        return out

    # -- resume -----------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The prompt cursor, the sampler and the window: every admitted group with its samples' tokens so far."""
        if self._lanes:
            self._interrupt()
        with self._cond:
            window = [
                {"item": dataclasses.asdict(c.item), "slots": [dataclasses.asdict(s) for s in c.slots]}
                for c in self.window
            ]
            own = {"kind": "stream", "version": self.version, "window": window, "totals": dict(self.totals)}
        return {"prompts": self.prompts.state_dict(), "sampler": self.sampler.state_dict(), "stream": own}

    def load_state_dict(self, state: dict) -> None:
        if state.get("schedule") or (state.get("async") or {}).get("ready"):
            raise ConfigError("the checkpoint was saved by another rollout.schedule; resume it with that schedule")
        self.prompts.load_state_dict(state["prompts"])
        self.sampler.load_state_dict(state["sampler"])
        own = state.get("stream") or {"window": [], "totals": {}}
        self.window = [Carried(PromptItem(**c["item"]), [Slot(**s) for s in c["slots"]]) for c in own["window"]]
        self.queue = deque((c, j) for c in self.window for j, s in enumerate(c.slots) if not s.finished)
        for c in self.window:  # complete before the checkpoint: in window order
            self._note_completion(c)
        self.totals.update(own.get("totals", {}))
