"""The weight sync's boundary, walked without a cluster: each schedule's step (collect, train, before_sync, weight
sync, weights_updated) run for real on torch's fake process group, one rank at a time, every collective recorded in
order with its group: the control plane (gloo, ``rollout.control_timeout_s``) or the default group (NCCL on GPU).

    walk = walk_sync(cfg, world=128, ranks=[1])     # {0: [Event, ...], 1: [...]}: rank 0 is always walked
    lines = describe(walk)                          # {0: ["control: broadcast_object_list (step 1: next_batch)", ...]}
    failures = check_sync(walk, schedule_name(cfg)) # [] or what a rank does wrong, naming the schedule
    walks = walk_schedules(cfg, world, ranks)       # every schedule as a variant of cfg: {name: walk}

Why: while rank 0 alone finishes what generates (the producer's batch, the stream lanes' abort), the others must wait
on the control plane, not in the sync's default-group collectives, whose watchdog kills a rank after
``parallel.collective_timeout_s``. So every rank meets rank 0 on the control plane in ``before_sync`` before its
first default-group collective after training (``check_sync``), and every rank enters each group's collectives in
the same order (a mismatch is a hang, or worse, two different calls paired).

How: the schedules, the control plane (``loop/control.py``) and the batch's way to the actor (``loop/updates.py``) are
the product's own; the actor and the weight sync are stand-ins that make the real ones' collectives (an all-reduce per
update; the export's all_gather_object, then the engine update on rank 0 inside ``on_driver``). Rank 0 runs first,
with a tiny instant engine; what it broadcasts is kept and handed to the other ranks' matching broadcast (same group,
step, phase and place in the phase). The fake backend cannot create gloo groups: a gloo group asked for is a fake one
here, recorded as the control plane. The walk shrinks the batch to the recipe's update count (one prompt per
mini-batch, groups of 2, 4 new tokens, no overlong penalty) and generates with the engine itself (``rollout.generate``
off): none of it changes which collectives a rank enters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist

from megatron_dapo.algo.sampling import DynamicSampler
from megatron_dapo.config.run_config import DapoConfig
from megatron_dapo.data.dataset import PromptItem
from megatron_dapo.engines.base import EngineBase
from megatron_dapo.loop import control
from megatron_dapo.types import GenRequest, Sample, TokenizerInfo, sample_seed

# each schedule the loop runs: (rollout.schedule, rollout.partial, train.stream_updates)
SCHEDULES = {
    "sync": ("sync", False, False),
    "partial": ("sync", True, False),
    "one_step_off": ("one_step_off", False, False),
    "async": ("async", True, False),
    "stream": ("stream", True, False),
    "stream_updates": ("stream", True, True),
}
# the collectives recorded: torch.distributed's, as the product calls them (``dist.<name>``)
COLLECTIVES = (
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list", "barrier",
    "monitored_barrier", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "batch_isend_irecv",
)  # fmt: skip
EOS = 2


@dataclass(frozen=True)
class Event:
    """One collective a rank entered: its group's plane ('control' or 'default'), the group ('default', 'control':
    ``control.control_group()``, 'control#k': the k-th other gloo group, e.g. a DP share's), the call, and where the
    loop was (step, phase)."""

    plane: str
    group: str
    op: str
    step: int
    phase: str

    def __str__(self) -> str:
        shown = "control-dp" if self.group.startswith("control#") else self.group
        return f"{shown}: {self.op} (step {self.step}: {self.phase})"


def schedule_name(cfg: DapoConfig) -> str:
    """The name in ``SCHEDULES`` of the schedule ``cfg`` runs."""
    r = cfg.rollout
    key = (r.schedule, r.partial or r.schedule == "stream", cfg.train.stream_updates)
    return next(name for name, spec in SCHEDULES.items() if spec == key)


def walk_config(cfg: DapoConfig, name: str | None = None) -> DapoConfig:
    """``cfg`` running schedule ``name`` (default: its own), shrunk for the walk (module docstring)."""
    kind, partial, streamed = SCHEDULES[name or schedule_name(cfg)]
    r, a, t = cfg.rollout, cfg.algo, cfg.train
    updates = max(1, cfg.num_updates)
    return dataclasses.replace(
        cfg,
        rollout=dataclasses.replace(
            r, schedule=kind, partial=partial and kind != "stream", generate=None,
            sampling=dataclasses.replace(r.sampling, max_new_tokens=4),
        ),
        algo=dataclasses.replace(
            a, group_size=2, gen_batch_prompts=updates, max_gen_batches=0, overlong_penalty=False
        ),
        train=dataclasses.replace(
            t, batch_prompts=updates, mini_batch_prompts=1, stream_updates=streamed, steps=2 * r.sync_every
        ),
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------------
# Stand-ins: an engine that answers at once, prompts, a scorer, the actor's and the sync's collectives


class InstantEngine(EngineBase):
    """Every request answers at once with its budget's tokens (at most 3, then EOS); ``abort()`` is a no-op."""

    def __init__(self):
        self.tokenizer = TokenizerInfo((EOS,), 0, decode=lambda ids: " ".join(map(str, ids)))
        self.weight_version = 0

    def stream_lanes(self) -> tuple[int, int]:
        return 2, 1

    def generate_requests(self, requests: list[GenRequest], sampling) -> Iterator[Sample]:
        for i, r in enumerate(requests):
            n = min(r.max_new_tokens, 3)
            ids = [7] * (n - 1) + [EOS]
            yield Sample(list(r.input_ids), ids, [-0.5] * n, "stop", text=self.tokenizer.text(ids), prompt_index=i)

    def generate_stream(self, prompts, sampling, n: int = 1) -> Iterator[list[Sample]]:
        for p, ids in enumerate(prompts):
            reqs = [GenRequest(list(ids), sampling.max_new_tokens, sample_seed(sampling.seed, p, j)) for j in range(n)]
            group = list(self.generate_requests(reqs, sampling))
            for j, s in enumerate(group):
                s.prompt_index, s.sample_index = p, j
            yield group

    def update_weights(self, buckets, version: int) -> None:
        self.weight_version = version


class CountingPrompts:
    """Prompts 0, 1, 2, ... (never runs out); the cursor is the state."""

    def __init__(self):
        self.position = 0

    def take(self, n: int) -> list[PromptItem]:
        out = [
            PromptItem(k, [10 + k % 50, 3], f"p{k}", "0", "walk", []) for k in range(self.position, self.position + n)
        ]
        self.position += n
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


class HalfRight:
    """The even samples of each group right, the odd wrong: every group is informative (dynamic sampling keeps it)."""

    def score_batch(self, texts, items):
        return [{"score": 1.0 if i % 2 == 0 else -1.0, "acc": i % 2 == 0} for i in range(len(texts))]

    def metrics(self, reset: bool = False) -> dict:
        return {}


class StandInActor:
    """The actor as the step boundary sees it: per DP rank its global ranks (``dp_members``, what ``scatter_batch``
    sends over), and each mini-batch update's gradient all-reduce on the default group. ``during_update``: a context
    each update runs in (the walk labels its collectives 'train')."""

    def __init__(self, dp_members: list[list[int]], num_updates: int):
        self.dp_members, self.dp_size, self.num_updates = dp_members, len(dp_members), num_updates
        self.during_update = contextlib.nullcontext

    def _update(self) -> None:
        with self.during_update():
            dist.all_reduce(torch.zeros(1))

    def train_step(self, seqs: list) -> dict[str, float]:
        for _ in range(self.num_updates):
            self._update()
        return {}

    def train_streamed(self, next_mini, count: int) -> int:
        for k in range(count):
            next_mini(k)
            self._update()
        return count

    def finish_step(self, tally) -> dict[str, float]:
        return {}


def whole_batch_shares(actor, seqs: list, one_update: bool = False) -> list[set[int]]:
    """``actor/shares.dp_shares`` for the stand-in actor: every DP rank is sent every sequence whole."""
    return [set(range(len(seqs))) for _ in range(actor.dp_size)]


def sync_weights(engine, version: int) -> None:
    """The weight sync's collectives (``RolloutDriver.sync_weights``): the export's gathers on the default group
    (``bridge/export.py`` opens with an all_gather_object), then rank 0 updates its engine inside ``on_driver``."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dist.get_rank())
    control.on_driver(lambda: engine.update_weights([], version) if engine is not None else None)


def dp_members(cfg: DapoConfig, world: int) -> list[list[int]]:
    """Per DP rank, its global ranks, in megatron-core's rank order (``RankGenerator``, order tp-cp-ep-dp-pp)."""
    from megatron.core.parallel_state import RankGenerator

    p = cfg.parallel
    if world % (p.tp * p.pp * p.cp):
        raise ValueError(f"{world} ranks: not a multiple of tp x pp x cp = {p.tp * p.pp * p.cp}")
    dp = world // (p.tp * p.pp * p.cp)
    groups = RankGenerator(tp=p.tp, ep=1, dp=dp, pp=p.pp, cp=p.cp, order="tp-cp-ep-dp-pp").get_ranks("dp")
    return [sorted(g[d] for g in groups) for d in range(dp)]


# ----------------------------------------------------------------------------------------------------------------------
# The recorder


class Recorder:
    """Replaces torch.distributed's collectives while a rank is walked: each call is recorded (``events``), tensor
    collectives run on the fake backend (no data moves), object broadcasts replay rank 0's ``sent`` objects."""

    def __init__(self, rank: int, sent: dict):
        self.rank, self.sent = rank, sent  # sent: (group, step, phase, k) -> rank 0's object (pickled)
        self.events: list[Event] = []
        self.step, self.phase = 0, "start"
        self.groups: dict[int, tuple[str, str]] = {}  # id(group) -> (plane, name)
        self._gloo = 0
        self._calls: dict[Event, int] = {}  # how many times each call was made (its place in its phase)
        self.raised_at: tuple[int, str] | None = None  # where the walk of this rank raised

    @contextlib.contextmanager
    def at(self, step: int, phase: str):
        before = (self.step, self.phase)
        self.step, self.phase = step, phase
        try:
            yield
        except Exception:
            self.raised_at = self.raised_at or (self.step, self.phase)
            raise
        finally:
            self.step, self.phase = before

    def group_of(self, group) -> tuple[str, str]:
        if group is None or group is dist.group.WORLD:
            return "default", "default"
        if group is control._CONTROL["group"]:
            return "control", "control"
        return self.groups.get(id(group), ("other", "other"))

    def new_group(self, real):
        def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
            group = real(ranks, timeout, "fake", *args, **kwargs)
            if str(backend).lower() == "gloo":  # the control plane's (control.py): gloo, never the default group
                self._gloo += 1  # in creation order, the same on every rank
                self.groups[id(group)] = ("control", f"control#{self._gloo}")
            return group

        return new_group

    def collective(self, name: str, real):
        signature = inspect.signature(real)

        def call(*args, **kwargs):
            plane, gname = self.group_of(signature.bind(*args, **kwargs).arguments.get("group"))
            event = Event(plane, gname, name, self.step, self.phase)
            self.events.append(event)
            self._calls[event] = self._calls.get(event, 0) + 1
            if name == "broadcast_object_list":
                return self._broadcast_objects(event, *args, **kwargs)
            if name == "all_gather_object":
                out, obj = args[0], args[1]
                out[:] = [pickle.loads(pickle.dumps(obj)) for _ in out]
                return None
            if name in ("barrier", "monitored_barrier"):
                return None
            return real(*args, **kwargs)

        return call

    def _broadcast_objects(self, event: Event, object_list: list, src: int = 0, group=None, **_) -> None:
        key = (event.group, event.step, event.phase, self._calls[event])  # the n-th such call in this phase
        if self.rank == src:
            self.sent[key] = pickle.dumps(list(object_list))
        elif key in self.sent:
            object_list[:] = pickle.loads(self.sent[key])
        else:  # rank 0 made no such call: a hang on a cluster (check_sync names it); go on with an empty outcome
            object_list[:] = [("ok", None)] * len(object_list)


@contextlib.contextmanager
def fake_rank_of(world: int, rank: int, recorder: Recorder) -> Iterator[None]:
    """This process is ``rank`` of ``world`` on the fake backend, every collective recorded, the control plane's
    cached groups (``control._CONTROL``, ``control._DP``) fresh for this rank and restored afterwards."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("control walk: torch.distributed is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    patches = [mock.patch.object(dist, "new_group", recorder.new_group(dist.new_group))]
    patches += [mock.patch.object(dist, n, recorder.collective(n, getattr(dist, n))) for n in COLLECTIVES]
    patches += [
        mock.patch.dict(control._CONTROL, {"group": None}),
        mock.patch.dict(control._DP, clear=True),
        mock.patch("megatron_dapo.actor.shares.dp_shares", whole_batch_shares),
    ]
    try:
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            yield
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------------
# The walk


def _walk_rank(cfg: DapoConfig, world: int, rank: int, members: list[list[int]], sent: dict) -> list[Event]:
    """``rank``'s collectives over the trainer's calls (loop/trainer.py ``run``): the first sync and weights_updated,
    then per step collect, train, and at each sync step before_sync, the sync, weights_updated."""
    from megatron_dapo.loop.schedule import make_schedule
    from megatron_dapo.loop.updates import make_updates

    rec = Recorder(rank, sent)
    with fake_rank_of(world, rank, rec):
        engine = InstantEngine() if rank == 0 else None  # rank 0 alone generates
        sampler = DynamicSampler(cfg.train.batch_prompts, 0, enabled=cfg.algo.dynamic_sampling)
        schedule = make_schedule(cfg, engine, CountingPrompts(), sampler, HalfRight() if rank == 0 else None)
        actor = StandInActor(members, cfg.num_updates)
        actor.during_update = lambda: rec.at(rec.step, "train")
        updates = make_updates(cfg, schedule, actor)
        try:
            with rec.at(0, "sync"):
                sync_weights(engine, 0)
            with rec.at(0, "weights_updated"):
                schedule.weights_updated(0)
            for step in range(1, cfg.train.steps + 1):
                with rec.at(step, "next_batch"):
                    seqs, _ = updates.collect(step)
                with rec.at(step, "train"):
                    updates.train(seqs)
                if step % cfg.rollout.sync_every == 0 or step == cfg.train.steps:
                    with rec.at(step, "before_sync"):
                        schedule.before_sync()
                    with rec.at(step, "sync"):
                        sync_weights(engine, step)
                    with rec.at(step, "weights_updated"):
                        schedule.weights_updated(step)
        except Exception as e:  # recorded where it happened: check_sync names it
            step, phase = rec.raised_at or (rec.step, rec.phase)
            rec.events.append(Event("error", "error", f"{type(e).__name__}: {e}", step, phase))
        finally:
            schedule.close()
    return rec.events


def walk_sync(
    cfg: DapoConfig, world: int, ranks: list[int] = (1,), schedule: str | None = None
) -> dict[int, list[Event]]:
    """The collectives each of ``ranks`` (and rank 0, always: the others replay its broadcasts) enters, in order,
    over the trainer's steps around two weight syncs, for ``schedule`` (a name of ``SCHEDULES``; default ``cfg``'s)
    at ``world`` ranks with ``cfg``'s parallel layout."""
    if world < 2:
        raise ValueError(f"world = {world}: the control plane needs two ranks or more")
    if any(not 0 <= r < world for r in ranks):
        raise ValueError(f"ranks {ranks}: not all in 0..{world - 1}")
    walked = walk_config(cfg, schedule)
    members, sent = dp_members(cfg, world), {}
    out = {0: _walk_rank(walked, world, 0, members, sent)}
    for r in sorted(set(ranks) - {0}):
        out[r] = _walk_rank(walked, world, r, members, sent)
    return out


def walk_schedules(
    cfg: DapoConfig, world: int, ranks: list[int] = (1,), names: list[str] | None = None
) -> dict[str, dict[int, list[Event]]]:
    """``walk_sync`` for each schedule in ``names`` (default: all of ``SCHEDULES``), as variants of ``cfg``."""
    return {name: walk_sync(cfg, world, ranks, name) for name in names or SCHEDULES}


# ----------------------------------------------------------------------------------------------------------------------
# Reading a walk


def describe(walk: dict[int, list[Event]], compact: bool = True) -> dict[int, list[str]]:
    """Each rank's collectives as text; ``compact``: repeats in a row as one line with ``x n``."""
    out = {}
    for rank, events in walk.items():
        lines: list[str] = []
        counts: list[int] = []
        for e in map(str, events):
            if compact and lines and lines[-1] == e:
                counts[-1] += 1
            else:
                lines.append(e)
                counts.append(1)
        out[rank] = [f"{line} x {n}" if n > 1 else line for line, n in zip(lines, counts)]
    return out


def check_sync(walk: dict[int, list[Event]], schedule: str) -> list[str]:
    """What goes wrong at the weight sync, one line each naming ``schedule`` ([] when nothing does):

    - a rank whose walk raised (the schedule's error, or a broadcast rank 0 never made);

    - a rank but rank 0 whose first default-group collective after a step's training comes before its control-plane meeting in
      ``before_sync`` (it would wait for rank 0's drain inside the default group, under its watchdog);
    - a rank whose collectives on a group it shares with rank 0 differ from rank 0's in order (a hang on a cluster)."""
    failures = [] if set(walk) - {0} else [f"{schedule}: no rank but rank 0 walked: nothing to check"]
    failures += [
        f"{schedule}: rank {rank}'s walk raised at step {e.step} ({e.phase}): {e.op}"
        for rank, events in sorted(walk.items())
        for e in events
        if e.plane == "error"
    ]
    for rank, events in sorted(walk.items()):
        if rank == 0:  # the driver drains; the others must not wait for it in the default group
            continue
        for step in sorted({e.step for e in events if e.phase == "sync" and e.step > 0}):
            mine = [e for e in events if e.step == step]
            trained = max((i for i, e in enumerate(mine) if e.phase in ("next_batch", "train")), default=-1)
            later = list(enumerate(mine))[trained + 1 :]
            met = next((i for i, e in later if e.plane == "control" and e.phase == "before_sync"), None)
            first = next(((i, e) for i, e in later if e.plane == "default"), None)
            if first is not None and (met is None or first[0] < met):
                failures.append(
                    f"{schedule}: rank {rank} enters '{first[1]}' before meeting rank 0 on the control plane in "
                    f"before_sync (step {step}): it would wait for rank 0's drain inside the default group"
                )
    failures += _order_mismatches(walk, schedule)
    return failures


def _order_mismatches(walk: dict[int, list[Event]], schedule: str) -> list[str]:
    """Per group rank 0 shares with another walked rank: the same calls in the same order (step, phase, op)."""
    out = []
    driver = walk.get(0, [])
    for rank, events in sorted(walk.items()):
        if rank == 0:
            continue
        for group in sorted({e.group for e in events if e.plane != "error"}):
            a = [(e.step, e.phase, e.op) for e in driver if e.group == group]
            b = [(e.step, e.phase, e.op) for e in events if e.group == group]
            if a != b:
                k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                out.append(
                    f"{schedule}: on group '{group}' rank {rank}'s collective #{k + 1} is {_call(b, k)}, rank 0's is "
                    f"{_call(a, k)}: the ranks' calls do not pair"
                )
    return out


def _call(calls: list[tuple[int, str, str]], k: int) -> str:
    return "{2} (step {0}: {1})".format(*calls[k]) if k < len(calls) else "nothing"
