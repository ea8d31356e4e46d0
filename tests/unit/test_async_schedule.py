"""one_step_off and bounded-staleness async (loop/async_schedule.py) on the tick engine of test_schedule.py, driven
by a stand-in for the trainer's loop (next_batch, train, before_sync, sync, weights_updated): the producer runs ahead
by at most its depth, never generates across a weight change, tags every token's lag, and its checkpoint resumes
exactly (no prompt lost, none trained twice)."""

from __future__ import annotations

import re
import threading
import time

import pytest

from megatron_dapo.config.run_config import load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.loop.async_schedule import AsyncSchedule
from megatron_dapo.loop.schedule import SyncSchedule
from megatron_dapo.types import GenRequest, sample_seed
from tests.unit.test_schedule import MAX_NEW, TickEngine, items
from tests.unit.test_schedule import cfg as partial_cfg
from tests.unit.test_schedule import schedule as make

pytestmark = pytest.mark.timeout(60)


class VersionEngine(TickEngine):
    """Records the weights the schedule says the engines hold at each call (``calls``: (version, requests)) and as
    each sample comes back (``samples``: (step in production, version)); each sample takes ``delay`` s. ``generate_stream`` (the sync inner schedule's call) on top of ``generate_requests``."""

    def __init__(self, delay: float = 0.0):
        super().__init__()
        self.schedule, self.delay, self.calls, self.samples = None, delay, [], []
        self.in_call = threading.Event()

    def generate_requests(self, requests, sampling):
        self.calls.append((self.schedule.version, [list(r.input_ids) for r in requests]))
        self.in_call.set()
        for s in super().generate_requests(requests, sampling):
            time.sleep(self.delay)
            self.samples.append((self.schedule.next_step, self.schedule.version))  # the weights as it comes back
            yield s
        self.in_call.clear()

    def generate_stream(self, prompts, sampling, n=1):
        reqs = [GenRequest(list(p), MAX_NEW, sample_seed(sampling.seed, i, j)) for i, p in enumerate(prompts)
                for j in range(n)]  # fmt: skip
        groups: dict[int, list] = {}
        for s in self.generate_requests(reqs, sampling):
            p, j = divmod(s.prompt_index, n)
            s.prompt_index, s.sample_index = p, j
            groups.setdefault(p, []).append(s)
            if len(groups[p]) == n:
                yield sorted(groups.pop(p), key=lambda x: x.sample_index)


def cfg(mode: str = "one_step_off", *extra: str):
    return partial_cfg(f"rollout.schedule={mode}", "rollout.colocate=false", *extra)


def schedule(c, delay: float = 0.0, data=None):
    engine = VersionEngine(delay)
    s = make(c, engine, data)
    engine.schedule = s
    return s


def loop(s, steps: int, start: int = 1, train=lambda step: None):
    """The trainer's calls per step, as loop/trainer.py makes them; (groups, metrics, stats, seqs) per step."""
    out = []
    for step in range(start, start + steps):
        seqs, (metrics, stats) = s.next_batch(step)
        out.append((list(s.groups), metrics, stats, seqs))
        train(step)
        s.before_sync()
        s.weights_updated(step)  # the sync
    return out


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.005)
    return pred()


def test_config_picks_validates_and_turns_tis_on():
    assert type(schedule(cfg())) is AsyncSchedule and schedule(cfg()).depth == 1
    assert schedule(cfg("async", "rollout.max_staleness=3")).depth == 3
    assert type(schedule(cfg("sync"))) is not AsyncSchedule
    with pytest.raises(ConfigError, match="rollout.schedule = 'one_step_off'.*colocate"):
        partial_cfg("rollout.schedule=one_step_off")  # rollout.colocate defaults to true
    with pytest.raises(ConfigError, match="rollout.max_staleness = 0"):
        cfg("async", "rollout.max_staleness=0")
    with pytest.raises(ConfigError, match="rollout.max_staleness.*ignored"):
        cfg("one_step_off", "rollout.max_staleness=3")
    with pytest.raises(ConfigError, match="rollout.schedule"):
        load_config(None, ["data.synthetic=add2", "rollout.schedule=two_steps_off"])
    c = cfg("one_step_off", "rollout.partial=false")
    assert c.tis_possible and not c.tis_enabled and not cfg("one_step_off", "algo.tis=off").tis_possible


@pytest.mark.parametrize("partial", ["true", "false"])
def test_one_step_off_generates_the_next_batch_on_the_previous_weights_while_the_step_trains(partial):
    s = schedule(cfg("one_step_off", f"rollout.partial={partial}"))
    ahead = []

    def train(step):  # while step trains, step + 1's batch is made, not step + 2's (depth 1)
        assert wait_for(lambda: len(s.ready) == 1 and not s._busy)
        ahead.append((s.ready[0].step, s.ready[0].version))
        time.sleep(0.02)
        assert len(s.ready) == 1

    steps = loop(s, 5, train=train)
    assert ahead == [(2, 0)] + [(k + 1, k - 1) for k in range(2, 6)]  # (step it is for, weights it is made on)
    for step, (groups, metrics, _, seqs) in enumerate(steps, start=1):
        fresh = 0 if step == 1 else 1  # step 1 waits for its batch on the trainer's weights, the rest are one off
        assert metrics["rollout/batch_lag"] == fresh
        assert min(lag for g in groups for row in g.token_lag for lag in row) == fresh
        for g, k in zip(groups, range(0, len(seqs), len(groups[0].responses))):
            for lags, seq in zip(g.token_lag, seqs[k:]):
                assert (seq.tis_mask is None) if not any(lags) else seq.tis_mask.tolist() == [x > 0 for x in lags]
        assert all(len(r) <= MAX_NEW for g in groups for r in g.responses)
    assert steps[-1][1]["rollout/version_lag_max"] >= 1 and steps[-1][1]["rollout/partial_token_frac"] == 1.0


def test_no_batch_is_generated_across_a_weight_change_and_async_runs_ahead_by_its_bound():
    s = schedule(cfg("async", "rollout.max_staleness=2"), delay=0.0005)
    seen = []

    def train(step):
        assert wait_for(lambda: not s._busy and not s._may_start())  # the producer is as far ahead as it may be
        seen.append([(b.step, b.version) for b in s.ready])

    loop(s, 4, train=train)
    # while step k trains (trainer at k - 1): batches up to k + 2 made, each on weights at most 2 versions behind
    assert seen[0] == [(2, 0), (3, 0)] and seen[-1][-1] == (6, 3)
    for ready in seen:
        assert all(step - 1 - version <= 2 for step, version in ready)
    # the sync never runs under a batch: every call of a batch is made on the weights it started on
    s1 = schedule(cfg("async", "rollout.max_staleness=2"), delay=0.001)
    loop(s1, 5)  # no training time: the boundary comes while the producer is busy
    versions: dict[int, set] = {}
    for step, version in s1.engine.samples:
        versions.setdefault(step, set()).add(version)
    # (a step may take its whole batch from the carried partial groups and generate nothing: not every step shows)
    assert len(versions) >= 3 and all(len(v) == 1 for v in versions.values()), versions
    s2 = schedule(cfg("one_step_off"), delay=0.002)
    s2.next_batch(1)
    assert wait_for(s2.engine.in_call.is_set)
    s2.before_sync()  # step 2's batch is in progress: the boundary waits for it, whole
    assert not s2._busy and [b.step for b in s2.ready] == [2] and not s2.engine.in_call.is_set()
    n = len(s2.engine.calls)
    s2.weights_updated(1)
    time.sleep(0.05)
    assert len(s2.engine.calls) == n  # paused until the next next_batch (eval and save use the engine meanwhile)


def test_every_prompt_taken_is_trained_once_filtered_carried_dropped_or_ready():
    data = items(500)
    s = schedule(cfg("async", "rollout.partial_max_age=1"), data=data)
    ahead = lambda step: wait_for(lambda: not s._busy and not s._may_start())  # noqa: E731
    trained = [tuple(g.prompt_ids) for groups, *_ in loop(s, 8, train=ahead) for g in groups]
    ready = [tuple(g.prompt_ids) for b in s.ready for g in b.groups]
    carried = [tuple(c.item.prompt_ids) for c in s.inner.carried]
    st = s.sampler.stats()
    filtered = st["total_dropped_all_correct"] + st["total_dropped_all_wrong"]
    dropped = s.inner.totals["dropped_stale_groups"]
    assert ready and len(trained) + len(ready) + len(carried) + filtered + dropped == s.prompts.position
    assert len(set(trained + ready + carried)) == len(trained) + len(ready) + len(carried)


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_state_dict_holds_the_untrained_batches_and_resumes_exactly(mode):
    a = schedule(cfg(mode))
    ahead = lambda step: wait_for(lambda: not a._busy and not a._may_start())  # noqa: E731 (as far as it may go)
    before = [tuple(g.prompt_ids) for groups, *_ in loop(a, 3, train=ahead) for g in groups]
    state = a.state_dict()  # "killed" after step 3's save
    n = len(state["async"]["ready"])
    assert n and state["async"]["next_step"] == 4 + n
    b = schedule(cfg(mode))
    b.load_state_dict(state)
    b.weights_updated(3)
    steps_a, steps_b = loop(a, 3, start=4), loop(b, 3, start=4)
    for k, ((ga, ma, sa, _), (gb, mb, sb, _)) in enumerate(zip(steps_a, steps_b)):
        if mode == "async" and k >= n:  # async: how far ahead the producer gets depends on the timing
            break
        assert [(x.prompt_ids, x.responses, x.token_lag) for x in ga] == [(x.prompt_ids, x.responses, x.token_lag)
                                                                           for x in gb]  # fmt: skip
        assert {k: v for k, v in ma.items() if not k.startswith("time/")} == {
            k: v for k, v in mb.items() if not k.startswith("time/")
        }
        assert sa == sb
    # across the "kill": every prompt the resumed schedule took is trained once, or still held, or filtered/dropped
    after = [tuple(g.prompt_ids) for groups, *_ in steps_b for g in groups]
    held = [tuple(g.prompt_ids) for x in b.ready for g in x.groups]
    held += [tuple(c.item.prompt_ids) for c in b.inner.carried]
    st = b.sampler.stats()
    other = st["total_dropped_all_correct"] + st["total_dropped_all_wrong"] + b.inner.totals["dropped_stale_groups"]
    assert len(set(before + after + held)) == len(before + after + held)
    assert len(before + after + held) + other == b.prompts.position
    with pytest.raises(ConfigError, match=f"rollout.schedule={mode}"):
        make(partial_cfg()).load_state_dict(state)  # a sync (partial) run would lose the made batches
    if mode == "async":
        assert [(x["step"], x["version"]) for x in state["async"]["ready"]] == [(4, 1), (5, 2)]
        with pytest.raises(ConfigError, match="resume with the schedule it was saved with"):
            schedule(cfg("one_step_off")).load_state_dict(state)  # its batches are 2 versions ahead


def test_a_producer_failure_is_raised_in_the_trainer():
    s = schedule(cfg())

    def broken(requests, sampling):
        raise RuntimeError("server 3 died")
        yield

    s.engine.generate_requests = broken
    with pytest.raises(RuntimeError, match="server 3 died"):
        s.next_batch(1)
    with pytest.raises(RuntimeError, match="server 3 died"):
        s.before_sync()  # and at every later call: the run stops
    s.close()
    assert isinstance(make(partial_cfg()), SyncSchedule)


def test_the_trainer_has_no_branch_on_the_schedule():
    from tests.helpers import REPO

    src = (REPO / "megatron_dapo" / "loop/trainer.py").read_text()
    # the mode is the schedule's, and whether updates stream is loop/updates.py's (which calls schedule.next_batch)
    assert not re.search(r"cfg\.(rollout\.(schedule|partial|max_staleness)|train\.stream_updates)\b", src)
    src += (REPO / "megatron_dapo" / "loop/updates.py").read_text()
    for call in ("schedule.next_batch", "schedule.before_sync()", "schedule.weights_updated(", "schedule.state_dict()",
                 "schedule.close()", "updates.collect(step)", "updates.train(seqs)"):  # fmt: skip
        assert call in src, call
