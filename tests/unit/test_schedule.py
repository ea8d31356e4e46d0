"""The rollout schedule (loop/schedule.py) on a fake engine that runs every request in parallel at one token per
tick, with long-tailed lengths: partial rollout's budgets, carry order, version tags, stale drops and resume."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_dapo.algo.batch import to_sequences
from megatron_dapo.algo.offpolicy import BudgetError, check_total_length, remaining_budget, version_lag_stats
from megatron_dapo.algo.sampling import DynamicSampler
from megatron_dapo.config.run_config import load_config
from megatron_dapo.data.dataset import PromptItem, PromptIterator
from megatron_dapo.engines.base import EngineBase
from megatron_dapo.loop.schedule import PartialSchedule, SyncSchedule, make_schedule
from megatron_dapo.types import Sample, TokenizerInfo

MAX_NEW, G = 16, 4
RESP = 100  # response tokens are >= RESP, prompt tokens < RESP


class TickEngine(EngineBase):
    """Every request generates one token per tick; its total length is drawn from its seed, long-tailed (most short,
    some of the hard prompts' run to the budget). ``abort()`` stops the clock: the unfinished keep what they have."""

    def __init__(self):
        self.tokenizer = TokenizerInfo((), 0, decode=lambda ids: " ".join(map(str, ids)))
        self.requests: list = []  # every request of every call, in order
        self._aborted = False

    def generate_requests(self, requests, sampling):
        self.requests += requests
        self._aborted = False
        want = []
        for r in requests:
            rng = random.Random(r.seed)
            hard = r.input_ids[0] % 8 == 0  # one prompt in 8 has long answers, some past the budget
            n = rng.randint(MAX_NEW // 2, 2 * MAX_NEW) if hard and rng.random() < 0.5 else rng.randint(1, 3)
            want.append(n)
        order = sorted(range(len(requests)), key=lambda i: (min(want[i], requests[i].max_new_tokens), i))
        tick = 0
        for i in order:
            r = requests[i]
            n = min(want[i], r.max_new_tokens)
            if self._aborted:
                n, finish = tick, "abort"  # what it had when the clock stopped
            else:
                tick, finish = n, ("stop" if want[i] <= r.max_new_tokens else "length")
            ids = [RESP + (r.seed + k) % 7 for k in range(n)]
            yield Sample(list(r.input_ids), ids, [-0.5] * n, finish, text=self.tokenizer.text(ids), prompt_index=i)

    def abort(self):
        self._aborted = True


class LengthScorer:
    """Correct when the whole response has an even number of tokens (groups are often mixed)."""

    def score_batch(self, texts, items):
        return [{"score": 1.0 if len(t.split()) % 2 == 0 else -1.0, "acc": len(t.split()) % 2 == 0} for t in texts]

    def metrics(self, reset=False):
        return {}


def items(n: int) -> list[PromptItem]:
    return [PromptItem(i, [1 + i % 50, 2 + i // 50, 3], f"p{i}", "0", "fake", []) for i in range(n)]  # distinct


def cfg(*extra: str):
    return load_config(None, ["data.synthetic=add2", "rollout.partial=true", f"rollout.sampling.max_new_tokens={MAX_NEW}",
                              f"algo.group_size={G}", "algo.gen_batch_prompts=16", "train.batch_prompts=4",
                              "train.mini_batch_prompts=4", "algo.overlong_penalty=false", "algo.max_gen_batches=50",
                              *extra])  # fmt: skip


def schedule(c, engine=None, data=None):
    data = data or items(500)
    sampler = DynamicSampler(c.train.batch_prompts, c.algo.max_gen_batches, enabled=c.algo.dynamic_sampling)
    return make_schedule(c, engine or TickEngine(), PromptIterator(data, seed=0), sampler, LengthScorer())


def run_steps(s, steps, start=1):
    out = []
    for step in range(start, start + steps):
        seqs, (metrics, stats) = s.next_batch(step)
        out.append((list(s.groups), metrics, stats, seqs))
        s.weights_updated(step)
    return out


def test_make_schedule_picks_the_mode():
    assert type(schedule(cfg("rollout.partial=false"))) is SyncSchedule
    assert type(schedule(cfg())) is PartialSchedule


def test_resumed_samples_get_only_the_budget_they_have_left():
    s = schedule(cfg())
    steps = run_steps(s, 5)
    resumed = [r for r in s.engine.requests if len(r.input_ids) > 3]
    assert resumed, "no sample was carried and resumed: the test checks nothing"
    for r in resumed:
        generated = len(r.input_ids) - 3
        assert all(t >= RESP for t in r.input_ids[3:])  # prompt + its own partial response
        assert r.max_new_tokens == MAX_NEW - generated
    for groups, *_ in steps:
        assert all(len(resp) <= MAX_NEW for g in groups for resp in g.responses)
    assert max(m["rollout/version_lag_max"] for _, m, _, _ in steps) >= 1


def test_groups_are_judged_complete_and_carried_groups_come_first():
    s = schedule(cfg())
    run_steps(s, 1)
    carried = [(list(c.item.prompt_ids), [list(x.response_ids) for x in c.slots if not x.finished])
               for c in s.carried]  # fmt: skip
    assert any(parts for _, parts in carried), "nothing in flight was carried"
    first = len(s.engine.requests)
    groups, *_ = run_steps(s, 1, start=2)[0]
    sent = s.engine.requests[first:]
    expected = [p + r for p, parts in carried for r in parts]  # the carried unfinished samples, in carry order
    assert [list(r.input_ids) for r in sent[: len(expected)]] == expected
    assert all(f != "abort" for g in groups for f in g.finish_reasons) and all(len(g.responses) == G for g in groups)


def test_a_group_spanning_versions_is_tagged_per_token_and_weighted_by_tis():
    c = cfg()
    s = schedule(c)
    found = None
    for groups, metrics, _, seqs in run_steps(s, 6):
        for g, k in zip(groups, range(0, len(seqs), G)):
            if any(0 in lags and any(lags) for lags in g.token_lag):
                found = (g, seqs[k : k + G], metrics)
    assert found, "no group spanning two weight versions in 6 steps"
    g, seqs, metrics = found
    for lags, seq in zip(g.token_lag, seqs):
        if any(lags):
            assert seq.tis_mask.tolist() == [lag > 0 for lag in lags]  # only the tokens from older weights
        else:
            assert seq.tis_mask is None
    assert 0 < metrics["rollout/partial_token_frac"] < 1
    # algo.tis = on weighs every token (no mask); off: none
    assert all(x.tis_mask is None for x in to_sequences([g], cfg("algo.tis='on'"))[0])
    assert (
        not cfg("algo.tis='off'").tis_possible and cfg().tis_possible and not cfg("rollout.partial=false").tis_possible
    )


def test_groups_older_than_the_bound_are_dropped_and_counted():
    s = schedule(cfg("rollout.partial_max_age=1"))
    run_steps(s, 1)
    n = len(s.carried)
    assert n
    s.weights_updated(3)  # two versions later: every carried group lags 2 > 1
    _, metrics, _, _ = run_steps(s, 1, start=4)[0]
    assert metrics["rollout/dropped_stale_groups"] == n and metrics["rollout/dropped_stale_samples"] == n * G
    assert metrics["rollout/dropped_stale_groups_total"] == n
    assert metrics["rollout/version_lag_max"] == 0  # nothing older than the trainer's weights was trained


def test_every_prompt_taken_is_trained_filtered_carried_or_dropped_once():
    data = items(500)
    s = schedule(cfg("rollout.partial_max_age=1"), data=data)
    trained = []
    for groups, *_ in run_steps(s, 8):
        trained += [tuple(g.prompt_ids) for g in groups]
    taken = s.prompts.position
    carried = [tuple(c.item.prompt_ids) for c in s.carried]
    filtered = s.sampler.stats()["total_dropped_all_correct"] + s.sampler.stats()["total_dropped_all_wrong"]
    dropped = s.totals["dropped_stale_groups"]
    assert len(trained) + len(carried) + filtered + dropped == taken
    prompts = [tuple(it.prompt_ids) for it in data]
    assert len(set(trained)) == len(trained) and not set(trained) & set(carried)
    assert len(set(prompts)) == len(prompts)  # distinct prompts: the sets above count each once


def test_state_dict_resumes_exactly():
    a = schedule(cfg())
    run_steps(a, 2)
    state = a.state_dict()
    assert state["schedule"]["carried"]
    b = schedule(cfg())
    b.load_state_dict(state)
    b.weights_updated(a.version)
    for (ga, ma, _, _), (gb, mb, _, _) in zip(run_steps(a, 3, start=3), run_steps(b, 3, start=3)):
        assert [(x.prompt_ids, x.responses, x.token_lag) for x in ga] == [(x.prompt_ids, x.responses, x.token_lag)
                                                                           for x in gb]  # fmt: skip
        assert ma == mb
    sync = schedule(cfg("rollout.partial=false"))
    with pytest.raises(Exception, match="rollout.partial=true"):
        sync.load_state_dict(state)


def test_budget_rules():
    assert remaining_budget(16, 0) == 16 and remaining_budget(16, 15) == 1
    for bad in (16, 17, -1):
        with pytest.raises(BudgetError):
            remaining_budget(16, bad)
    check_total_length(16, 16)
    with pytest.raises(BudgetError, match="max_new_tokens = 16"):
        check_total_length(17, 16)
    stats = version_lag_stats([[0, 0, 1, 2], [0]])
    assert stats == {"version_lag_mean": 0.6, "version_lag_max": 2.0, "partial_token_frac": 0.4,
                     "offpolicy_sample_frac": 0.5}  # fmt: skip
    assert torch.tensor(0).item() == 0
