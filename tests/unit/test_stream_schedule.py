"""The streaming schedule (loop/stream_schedule.py) on a fake engine that decodes one token per 5 ms on several lanes
at once: a long generation in flight at a sync does not hold the sync; it resumes after it on the new weights, its
later tokens carry the new version, and the correction weighs the older ones; nothing taken from the prompts is lost
or trained twice across a checkpoint."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_dapo.algo.sampling import DynamicSampler
from megatron_dapo.config.run_config import load_config
from megatron_dapo.data.dataset import PromptItem
from megatron_dapo.engines.base import EngineBase
from megatron_dapo.loop.schedule import make_schedule
from megatron_dapo.loop.stream_schedule import StreamSchedule
from megatron_dapo.types import Sample, TokenizerInfo

EOS, LONG, TICK = 1, 400, 0.005


class SlowEngine(EngineBase):
    """Each request decodes one token per TICK in its own lane; prompt 5's samples are LONG tokens, the others 3.
    ``abort()`` ends every call in flight: the samples come back with what they have ('abort')."""

    def __init__(self):
        self.tokenizer = TokenizerInfo((EOS,), 0, decode=lambda ids: " ".join(map(str, ids)))
        self.weight_version, self._gen, self.lock = 0, 0, threading.Lock()
        self.requests: list = []

    def stream_lanes(self):
        return 8, 1

    def generate_requests(self, requests, sampling):
        gen = self._gen
        for i, r in enumerate(requests):
            with self.lock:
                self.requests.append(r)
            total = LONG if r.input_ids[0] == 5 else 3
            have = len(r.input_ids) - 2
            ids = []
            while have + len(ids) < total and len(ids) < r.max_new_tokens:
                if self._gen != gen:
                    yield Sample(list(r.input_ids), ids, [-0.5] * len(ids), "abort", prompt_index=i)
                    break
                time.sleep(TICK)
                ids.append(EOS if have + len(ids) == total - 1 else 10 + self.weight_version)
            else:
                yield Sample(list(r.input_ids), ids, [-0.5] * len(ids), "stop", prompt_index=i)

    def abort(self):
        self._gen += 1


class Prompts:
    """Prompts 0, 1, 2, ... in order (prompt_ids [index, 9]); the cursor is the state."""

    def __init__(self):
        self.position = 0

    def take(self, n):
        out = [PromptItem(self.position + k, [self.position + k, 9], "", "0", "fake", []) for k in range(n)]
        self.position += n
        return out

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class BytePrompts(Prompts):
    """Prompt k is [k + 2] + "q=" in the byte tokenizer of tests/unit/test_tool_agent.py."""

    def take(self, n):
        from tests.unit.test_tool_agent import TOK

        out = [PromptItem(self.position + k, [self.position + k + 2, *TOK.encode("q=")], "q=", "178377", "tool", [])
               for k in range(n)]  # fmt: skip
        self.position += n
        return out


class AllRight:
    def score_batch(self, texts, items):
        return [{"score": 1.0, "acc": True} for _ in texts]

    def metrics(self, reset=False):
        return {}


def cfg(*extra):
    return load_config(None, ["data.synthetic=add2", "rollout.schedule=stream", "rollout.colocate=false",
                              "rollout.stream_staleness=0", "algo.group_size=2", "algo.gen_batch_prompts=8",
                              "train.batch_prompts=4", "train.mini_batch_prompts=4", "algo.dynamic_sampling=false",
                              "algo.overlong_penalty=false", "rollout.sampling.max_new_tokens=500", *extra])  # fmt: skip


def schedule(c, engine):
    s = make_schedule(c, engine, Prompts(), DynamicSampler(4, 0, enabled=False), AllRight())
    assert isinstance(s, StreamSchedule)
    return s


def test_a_sync_does_not_wait_for_a_long_generation_which_resumes_on_the_new_weights():
    c, engine = cfg(), SlowEngine()
    s = schedule(c, engine)
    try:
        seqs, (metrics, _) = s.next_batch(1)
        assert [g.prompt_ids[0] for g in s.groups] == [0, 1, 2, 3] and len(seqs) == 8
        long_group = next(g for g in s.window if g.item.index == 5)
        time.sleep(0.1)
        t0 = time.monotonic()
        s.before_sync()  # 400 tokens at 5 ms: 2 s to finish; the sync must not wait for it
        waited = time.monotonic() - t0
        assert waited < 0.5, f"the sync waited {waited:.2f} s for the generation in flight"
        had = [len(slot.response_ids) for slot in long_group.slots]
        assert all(0 < n < LONG for n in had) and all(set(slot.versions) == {0} for slot in long_group.slots)
        s.weights_updated(1)
        engine.weight_version = 1
        s.next_batch(2)  # prompts 4..7: waits for prompt 5, resumed with the budget it has left
        resumed = [r for r in engine.requests if r.input_ids[0] == 5 and len(r.input_ids) > 2]
        assert resumed and all(r.max_new_tokens == 500 - (len(r.input_ids) - 2) for r in resumed)
        g = next(g for g in s.groups if g.prompt_ids[0] == 5)
        for row, n, resp in zip(g.token_lag, had, g.responses):
            assert len(resp) == LONG and row == [1] * n + [0] * (LONG - n)  # step 2 trains version 1's weights
            assert resp[n:-1] == [11] * (LONG - n - 1)  # tokens after the sync: the new weights'
        seqs, metrics = s.groups, s._metrics(time.monotonic(), 0)
        assert metrics["rollout/partial_ratio"] > 0 and metrics["rollout/max_partial_span"] == 1
        from megatron_dapo.algo.batch import to_sequences

        k = [x.prompt_ids[0] for x in s.groups].index(5)
        for seq, row in zip(to_sequences(s.groups, c)[0][2 * k : 2 * k + 2], g.token_lag):
            assert seq.tis_mask.tolist() == [lag > 0 for lag in row]  # the correction weighs the older tokens
    finally:
        s.close()


def test_a_checkpoint_keeps_the_window_so_no_prompt_is_lost_or_trained_twice():
    c, engine = cfg(), SlowEngine()
    a = schedule(c, engine)
    trained = []
    try:
        a.next_batch(1)
        trained += [g.prompt_ids[0] for g in a.groups]
        a.before_sync()
        a.weights_updated(1)
        state = a.state_dict()
    finally:
        a.close()
    assert state["stream"]["window"] and any(
        s["response_ids"] and s["finish_reason"] == "abort" for c_ in state["stream"]["window"] for s in c_["slots"]
    )
    b = schedule(c, SlowEngine())
    b.load_state_dict(state)
    b.weights_updated(1)
    try:
        for step in (2, 3, 4):
            b.next_batch(step)
            trained += [g.prompt_ids[0] for g in b.groups]
            b.before_sync()
            b.weights_updated(step)
    finally:
        b.close()
    assert trained == list(range(16))  # prompt order, each once
    with pytest.raises(Exception, match="rollout.schedule=stream"):
        sync = load_config("demo_cpu", ["algo.group_size=2"])
        make_schedule(sync, SlowEngine(), Prompts(), DynamicSampler(4, 0, enabled=False), AllRight()).load_state_dict(
            state
        )


def test_mini_batches_come_as_their_groups_are_kept_and_make_the_batch_next_batch_makes():
    """train.stream_updates: step 2's batch is prompts 4..7 and prompt 5 takes 2 s; with one group per mini-batch
    the first (prompt 4) comes while prompt 5 still generates, and the mini-batches joined are the batch a twin
    schedule's ``next_batch`` cuts: the same groups in order, the same tokens, advantages and masks."""
    from megatron_dapo.algo.batch import to_sequences

    c = cfg("train.mini_batch_prompts=1", "algo.old_logprobs=rollout", "train.stream_updates=true")
    streamed, whole = schedule(c, SlowEngine()), schedule(c, SlowEngine())
    try:
        for step in (1, 2):
            minis, pending = [], []
            for seqs in streamed.mini_batches(step, 1):
                minis.append(seqs)
                pending.append(sum(not x.complete for x in streamed.window if x.item.index == 5))
            seqs, (metrics, stats) = whole.next_batch(step)
            assert [g.prompt_ids for g in streamed.groups] == [g.prompt_ids for g in whole.groups]
            joined, batch = [x for m in minis for x in m], streamed.last_batch[0]
            assert len(minis) == 4 and len(joined) == len(seqs) == len(batch) == 8
            for a, b, d in zip(joined, seqs, batch):
                assert torch.equal(a.tokens, b.tokens) and torch.equal(a.tokens, d.tokens)
                assert a.advantage == b.advantage and torch.equal(a.loss_mask, b.loss_mask)
            assert streamed.last_batch[1][1]["samples_generated"] == stats["samples_generated"] == 8
            for s_ in (streamed, whole):
                s_.before_sync()
                s_.weights_updated(step)
        assert pending[0] == 1  # step 2's first mini-batch came before prompt 5's group was complete
        assert to_sequences(streamed.groups, c)[0][0].tokens.tolist() == joined[0].tokens.tolist()
    finally:
        streamed.close()
        whole.close()


def test_stream_settings_are_checked_up_front():
    from megatron_dapo.config.typed_yaml import ConfigError

    with pytest.raises(ConfigError, match="rollout.sync_every = 2: syncs less often"):
        load_config("demo_cpu", ["rollout.sync_every=2"])
    with pytest.raises(ConfigError, match="eval.interval"):
        cfg("rollout.sync_every=2", "eval.interval=3")
    with pytest.raises(ConfigError, match="rollout.stream_staleness"):
        load_config("demo_cpu", ["rollout.stream_staleness=0.2"])  # ignored by sync: named
    assert cfg("rollout.sync_every=2", "eval.interval=4").rollout.sync_every == 2


def test_a_tool_agent_streams_and_a_sync_mid_turn_resumes_it_on_the_new_weights():
    """rollout.generate with stream: each lane runs one sample's tool agent; the sync cuts an answer turn short, it
    resumes after the sync from its recorded calls (the cut turn continued, not regenerated) and the tool's output
    stays masked; the tokens after the sync carry the new version."""
    from megatron_dapo.loop.rollout_fn import FunctionRollouts
    from tests.unit.test_partial_rollout_fn import ANSWER, INSERTED, CuttingEngine
    from tests.unit.test_tool_agent import CALL, TOK

    c = cfg("rollout.generate=megatron_dapo.rollouts.tool_agent:generate", "rollout.generate_args={tools: [calculator]}",
            "rollout.generate_concurrency=4", "algo.gen_batch_prompts=4")  # fmt: skip
    engine = CuttingEngine(version=0)
    engine.new_step, engine.step_restarts = (lambda: None), 0
    engine.stream_lanes = lambda: (4, 1)
    cut, aborted = threading.Event(), threading.Event()
    real = engine.generate_requests

    def slow_answers(requests, sampling):  # prompt 5's answer turn: 4 tokens, then held until the sync aborts it
        for s in real(requests, sampling):
            if s.prompt_ids[0] == 5 + 2 and "<tool_response>" in TOK.decode(s.prompt_ids) and not cut.is_set():
                cut.set()
                aborted.wait(10)
                s = Sample(s.prompt_ids, s.response_ids[:4], s.logprobs[:4], "abort", prompt_index=s.prompt_index)
            yield s

    engine.generate_requests, engine.abort = slow_answers, aborted.set
    rollouts = FunctionRollouts(c.rollout.generate, dict(c.rollout.generate_args), 4, engine, TOK)
    s = StreamSchedule(c, engine, BytePrompts(), DynamicSampler(4, 0, enabled=False), AllRight(), rollouts)
    try:
        s.next_batch(1)
        assert cut.wait(5)
        s.before_sync()
        s.weights_updated(1)
        engine.weight_version = 1
        s.next_batch(2)
        g = next(g for g in s.groups if g.prompt_ids[0] == 5 + 2)
        turn1 = TOK.encode(CALL) + [1]
        answer = TOK.encode(ANSWER) + [1]
        inserted = [0] * len(INSERTED)
        for resp, mask in zip(g.responses, g.loss_masks):
            assert resp == turn1 + INSERTED + answer  # the engine's tokens, the cut turn continued, not regenerated
            assert mask == [1] * len(turn1) + inserted + [1] * len(answer)  # the tool's output: never trained
        cut_row = next(row for row in g.token_lag if row[-1] == 0 and row[0] == 1)
        assert cut_row[len(turn1) + len(INSERTED) :][:4] == [1] * 4  # the 4 answer tokens before the sync: version 0
    finally:
        s.close()


def test_completion_order_trains_what_is_done_and_leaves_the_long_group_for_later():
    """rollout.stream_order=completion: prompt 5 (LONG tokens) is in the first window; in prompt order step 2 would
    wait for it, in completion order steps take the complete groups and prompt 5 is trained once it is done."""
    c, engine = cfg("rollout.stream_order=completion", "algo.gen_batch_prompts=8"), SlowEngine()
    s = schedule(c, engine)
    try:
        s.next_batch(1)
        first = [g.prompt_ids[0] for g in s.groups]
        t0 = time.monotonic()
        s.next_batch(2)  # groups 4, 6, 7, 8, ... are done long before prompt 5's 400 tokens
        second = [g.prompt_ids[0] for g in s.groups]
        assert time.monotonic() - t0 < 1.0 and 5 not in first + second  # in completion order, whichever finished
        assert len(set(first + second)) == 8 and set(first + second) <= set(range(12))
    finally:
        s.close()
    with pytest.raises(Exception, match="rollout.stream_order"):
        load_config("demo_cpu", ["rollout.stream_order=completion"])  # ignored by sync: named
