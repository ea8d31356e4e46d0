"""Partial rollout on the REAL SGLang 0.5.23 CPU server (the session's, tests/sglang/conftest.py): an aborted
/generate hands back the tokens and logprobs it has so far, the sample resumes from prompt + partial response with
the budget it has left, and the schedule's resumed samples never exceed max_new_tokens in total."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_dapo.algo.sampling import DynamicSampler
from megatron_dapo.config.run_config import load_config
from megatron_dapo.data.dataset import PromptItem, PromptIterator
from megatron_dapo.loop.schedule import PartialSchedule
from megatron_dapo.types import GenRequest, SamplingParams, TokenizerInfo
from tests.sglang.test_server import _server_requests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
BUDGET = 400  # the tiny model's context is 512


def test_an_aborted_request_keeps_its_tokens_and_resumes_with_the_budget_left(engine, server):
    requests = [GenRequest([1, 2 + i, 3], BUDGET, seed=i, route=i) for i in range(4)]
    sampling = SamplingParams(max_new_tokens=1, seed=0)  # each request's own budget is what counts

    def abort_once_running():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _server_requests(server.url) < len(requests):
            time.sleep(0.05)
        time.sleep(0.5)  # a few tokens in
        engine.abort()

    aborter = threading.Thread(target=abort_once_running, daemon=True)
    aborter.start()
    got = sorted(engine.generate_requests(requests, sampling), key=lambda s: s.prompt_index)
    aborter.join(timeout=60)
    partial = [s for s in got if s.finish_reason == "abort"]
    assert len(got) == len(requests) and partial, [(s.finish_reason, len(s.response_ids)) for s in got]
    for s in partial:  # SGLang answers an aborted /generate with 200, its output_ids and logprobs so far
        assert 0 < len(s.response_ids) < BUDGET and len(s.logprobs) == len(s.response_ids)
    resumed = [GenRequest(list(requests[s.prompt_index].input_ids) + s.response_ids, BUDGET - len(s.response_ids),
                          seed=7, route=s.prompt_index) for s in partial]  # fmt: skip
    answers = list(engine.generate_requests(resumed, sampling))  # in the order they finish
    assert sorted(s.prompt_index for s in answers) == list(range(len(resumed)))
    for s in answers:
        req = resumed[s.prompt_index]  # prompt_index: the request's position in the list sent
        assert s.finish_reason in ("stop", "length") and len(s.response_ids) <= req.max_new_tokens
        assert s.prompt_ids == req.input_ids  # the continuation's prompt is prompt + partial response


class Mixed:
    def score_batch(self, texts, items):
        return [{"score": 1.0, "acc": i % 2 == 0} for i, _ in enumerate(texts)]

    def metrics(self, reset=False):
        return {}


def test_the_schedule_resumes_on_the_server_within_the_budget(engine):
    max_new = 120
    cfg = load_config(None, ["data.synthetic=add2", "rollout.partial=true", f"rollout.sampling.max_new_tokens={max_new}",
                             "algo.group_size=2", "algo.gen_batch_prompts=6", "train.batch_prompts=1",
                             "train.mini_batch_prompts=1", "algo.overlong_penalty=false"])  # fmt: skip
    # two stop tokens: the random model stops after ~16 tokens on average, some run to the budget (a long tail)
    engine.tokenizer = TokenizerInfo((5, 7), 0, decode=lambda ids: " ".join(map(str, ids)))
    data = [PromptItem(i, [1, 2 + i, 3], f"p{i}", "0", "fake", []) for i in range(60)]
    engine.max_concurrency = 3  # fewer requests at once than the round has: later ones are behind at the cut
    sched = PartialSchedule(cfg, engine, PromptIterator(data, seed=0), DynamicSampler(1, 10), Mixed())
    sent: list[GenRequest] = []
    generate = engine.generate_requests

    def recording(requests, sampling):
        sent.extend(requests)
        yield from generate(requests, sampling)

    engine.generate_requests = recording
    for step in range(1, 6):
        sched.next_batch(step)
        for g in sched.groups:
            assert all(len(r) <= max_new for r in g.responses) and "abort" not in g.finish_reasons
        sched.weights_updated(step)
        if any(len(r.input_ids) > 3 for r in sent):
            break
    resumed = [r for r in sent if len(r.input_ids) > 3]
    assert resumed, "no sample was in flight at a cut in 5 steps"
    assert all(r.max_new_tokens == max_new - (len(r.input_ids) - 3) for r in resumed)
