"""The control walk (planning/control_walk.py): each schedule's step boundary on torch's fake process group, its
collectives recorded per rank and plane. Every schedule meets on the control plane before the sync's default-group
collectives; a planted removal of a schedule's meeting, a control plane on the default group, and a collective made
by one rank only are each caught, naming the schedule."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_dapo.config.run_config import load_config
from megatron_dapo.loop import control
from megatron_dapo.loop.async_schedule import AsyncSchedule
from megatron_dapo.loop.schedule import PartialSchedule, SyncSchedule
from megatron_dapo.loop.stream_schedule import StreamSchedule
from megatron_dapo.planning.control_walk import (
    SCHEDULES,
    check_sync,
    describe,
    schedule_name,
    walk_config,
    walk_schedules,
    walk_sync,
)

pytestmark = pytest.mark.timeout(120)
# the class whose before_sync holds each schedule's meeting (PartialSchedule: SyncSchedule's, inherited)
MEETING = {"sync": SyncSchedule, "partial": SyncSchedule, "one_step_off": AsyncSchedule, "async": AsyncSchedule,
           "stream": StreamSchedule, "stream_updates": StreamSchedule}  # fmt: skip
DRAIN = {SyncSchedule: "_drain", AsyncSchedule: "_drain", StreamSchedule: "_interrupt"}


@pytest.fixture(scope="module")
def cfg():
    return load_config("demo_cpu", [])  # 2 updates per step


def test_every_schedule_meets_on_the_control_plane_before_the_sync(cfg):
    walks = walk_schedules(cfg, world=2, ranks=[1])
    assert set(walks) == set(SCHEDULES)
    for name, walk in walks.items():
        assert check_sync(walk, name) == [], name
        assert not dist.is_initialized() and control._CONTROL["group"] is None  # left as found
    step1 = [line for line in describe(walks["sync"])[1] if "step 1" in line]
    assert step1 == [
        "control: broadcast_object_list (step 1: next_batch)",  # on_driver: rank 0's batch or its error
        "control-dp: broadcast_object_list (step 1: next_batch)",  # scatter_batch: DP rank 1's share
        "default: all_reduce (step 1: train) x 2",  # the 2 updates' gradient all-reduce
        "control: broadcast_object_list (step 1: before_sync)",  # the meeting: rank 0 drains meanwhile
        "default: all_gather_object (step 1: sync)",  # the export
        "control: broadcast_object_list (step 1: sync)",  # rank 0's engine update, its outcome
    ]
    streamed = [line for line in describe(walks["stream_updates"])[1] if "step 1" in line]
    assert streamed.index("default: all_reduce (step 1: train)") < streamed.index(
        "control: broadcast_object_list (step 1: before_sync)"
    )  # the updates run while the batch is collected
    assert streamed.count("default: all_reduce (step 1: train)") == 2


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_planted_removal_of_the_meeting_fails_the_check(cfg, name, monkeypatch):
    cls = MEETING[name]
    drain = DRAIN[cls]
    monkeypatch.setattr(cls, "before_sync", lambda self: getattr(self, drain)() if control.is_driver() else None)
    failures = check_sync(walk_sync(cfg, 2, [1], name), name)
    assert failures and all(f.startswith(f"{name}: rank 1 enters 'default: all_gather_object") for f in failures)
    assert "before meeting rank 0 on the control plane in before_sync (step 1)" in failures[0]


def test_only_partial_loses_its_meeting_when_only_partial_drops_it(cfg, monkeypatch):
    meet = SyncSchedule.before_sync
    monkeypatch.setattr(PartialSchedule, "before_sync", lambda self: self._drain() if control.is_driver() else None)
    walks = walk_schedules(cfg, 2, [1], ["sync", "partial"])
    assert check_sync(walks["sync"], "sync") == [] and check_sync(walks["partial"], "partial")
    assert SyncSchedule.before_sync is meet


def test_a_control_plane_on_the_default_group_fails_the_check(cfg, monkeypatch):
    monkeypatch.setattr(control, "control_group", lambda: None)  # every "control" call on the default group
    failures = check_sync(walk_sync(cfg, 2, [1], "async"), "async")
    assert failures and "rank 1 enters 'default: broadcast_object_list (step 1: before_sync)'" in failures[0]


def test_a_collective_of_one_rank_only_fails_the_check(cfg, monkeypatch):
    real = StreamSchedule.weights_updated

    def weights_updated(self, version):  # the other ranks meet once more; rank 0 never comes
        if not control.is_driver():
            control.control_barrier()
        real(self, version)

    monkeypatch.setattr(StreamSchedule, "weights_updated", weights_updated)
    failures = check_sync(walk_sync(cfg, 2, [1], "stream"), "stream")
    assert failures == [
        "stream: on group 'control' rank 1's collective #2 is barrier (step 0: weights_updated), rank 0's is "
        "broadcast_object_list (step 1: next_batch): the ranks' calls do not pair"
    ]


def test_an_error_of_rank_0_in_before_sync_is_named_on_every_rank(cfg, monkeypatch):
    def drain(self):
        raise RuntimeError("engine gone")

    monkeypatch.setattr(AsyncSchedule, "_drain", drain)
    failures = check_sync(walk_sync(cfg, 2, [1], "one_step_off"), "one_step_off")
    assert failures == [
        "one_step_off: rank 0's walk raised at step 1 (before_sync): RuntimeError: engine gone",
        "one_step_off: rank 1's walk raised at step 1 (before_sync): DriverError: rank 0: RuntimeError: engine gone",
    ]


def test_at_128_ranks_a_middle_rank_gets_its_dp_share_and_rank_0_sends_every_share(cfg):
    tp2 = load_config("demo_cpu", ["parallel.tp=2"])
    walk = walk_sync(tp2, 128, [77], "stream_updates")
    assert check_sync(walk, "stream_updates") == []
    shares = {r: sum(e.op == "broadcast_object_list" and e.group.startswith("control#") and e.step == 1 for e in walk[r])
              for r in walk}  # fmt: skip
    assert shares == {0: 2 * 64, 77: 2}  # 64 DP ranks (TP 2), one share per update; rank 0's own DP rank: none sent
    assert "control-dp: broadcast_object_list (step 1: next_batch) x 64" in describe(walk)[0]


def test_the_walk_names_the_schedule_of_a_config_and_shrinks_the_batch():
    stream = load_config("demo_cpu", ["rollout.schedule=stream", "rollout.colocate=false",
                                      "train.stream_updates=true", "algo.old_logprobs=rollout"])  # fmt: skip
    assert schedule_name(stream) == "stream_updates"
    assert schedule_name(load_config("demo_cpu", ["rollout.partial=true"])) == "partial"
    small = walk_config(stream, "one_step_off")
    assert (small.rollout.schedule, small.rollout.partial, small.train.stream_updates) == ("one_step_off", False, False)
    assert small.num_updates == stream.num_updates and small.train.batch_prompts == stream.num_updates
    with pytest.raises(ValueError, match="two ranks"):
        walk_sync(stream, 1, [0])
