"""Partial rollout with a rollout function (rollout.partial + rollout.generate): a tool agent aborted mid-turn keeps
its tokens and resumes on the next weights where it stopped. Its earlier calls are replayed, the cut call is
continued with the budget it had left, each token keeps the weight version it came from, and a tool's output stays
masked."""

from __future__ import annotations

import json
import threading

from megatron_dapo.data.dataset import PromptItem
from megatron_dapo.loop.rollout_fn import FunctionRollouts
from megatron_dapo.loop.schedule import Carried, PartialSchedule, Slot
from megatron_dapo.types import Sample, SamplingParams, TokenizerInfo
from tests.unit.test_tool_agent import CALL, EOS, TOK

INSERTED = TOK.encode(
    "\n<|im_start|>user\n<tool_response>\n178377\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)
ANSWER = "Answer: 178377"


class CuttingEngine:
    """Writes the tool call, then (after a tool response) the answer, continuing whatever part of it the context
    already ends with. ``cut = k``: the next answer request stops after k tokens, aborted (a sync cut it short)."""

    def __init__(self, version: int):
        self.tokenizer = TokenizerInfo((EOS,), 0, decode=lambda ids: TOK.decode(ids))
        self.weight_version, self.cut = version, None
        self.requests, self.lock = [], threading.Lock()

    def generate_requests(self, requests, sampling):
        for i, r in enumerate(requests):
            context = TOK.decode(r.input_ids)
            target = TOK.encode(ANSWER if "<tool_response>" in context else CALL) + [EOS]
            done = next(k for k in range(len(target), -1, -1) if k == 0 or r.input_ids[-k:] == target[:k])
            ids, finish = target[done:][: r.max_new_tokens], "stop"
            with self.lock:
                if self.cut is not None and "<tool_response>" in context:
                    ids, finish, self.cut = ids[: self.cut], "abort", None
                self.requests.append((list(r.input_ids), r.max_new_tokens, list(ids)))
            lps = [-0.1 * self.weight_version] * len(ids)
            yield Sample(list(r.input_ids), ids, lps, finish, prompt_index=i)

    def abort(self):
        pass


def test_a_tool_agent_cut_mid_turn_resumes_where_it_stopped_on_the_new_weights():
    engine = CuttingEngine(version=3)
    runner = FunctionRollouts("megatron_dapo.rollouts.tool_agent:generate", {"tools": ["calculator"]}, 2, engine, TOK)
    prompt = TOK.encode("<|im_start|>user\nWhat is 4821*37?<|im_end|>\n<|im_start|>assistant\n")
    item = PromptItem(0, prompt, "", "178377", "tool", [])
    calls: list[dict] = []
    sampling = SamplingParams(max_new_tokens=400, seed=1)
    stops = frozenset({EOS})
    engine.cut = 5  # the answer turn is aborted after 5 tokens
    assert list(runner.resume([(item, 0, 0, calls)], sampling, version=3, stops=stops)) == []  # aborted: kept
    turn1 = TOK.encode(CALL) + [EOS]
    assert [c["finish"] for c in calls] == ["stop", "abort"] and calls[0]["response_ids"] == turn1
    assert calls[1]["response_ids"] == TOK.encode(ANSWER)[:5] and calls[1]["versions"] == [3] * 5
    json.dumps(calls)  # plain data: checkpointed with the carried sample

    engine.weight_version = 4
    before = len(engine.requests)
    [(gi, j, sample, versions)] = runner.resume([(item, 0, 0, calls)], sampling, version=4, stops=stops)
    # one engine request: the cut turn, continued from its 5 tokens with what is left of the agent's budget
    [(context, budget, new)] = engine.requests[before:]
    assert context == prompt + turn1 + INSERTED + TOK.encode(ANSWER)[:5]
    assert budget == 400 - len(turn1) - len(INSERTED) - 5
    answer = TOK.encode(ANSWER)[:5] + new
    assert sample.response_ids == turn1 + INSERTED + answer  # what the engine generated, never generated twice
    assert sample.loss_mask == [1] * len(turn1) + [0] * len(INSERTED) + [1] * len(answer)
    assert sample.logprobs == [-0.1 * 3] * len(turn1) + [0.0] * len(INSERTED) + [-0.1 * 3] * 5 + [-0.1 * 4] * len(new)
    assert versions == [3] * len(turn1) + [4] * len(INSERTED) + [3] * 5 + [4] * len(new)
    assert sample.finish_reason == "stop" and sample.text.endswith(ANSWER)


def test_a_function_that_asks_something_new_gets_new_generations_and_is_counted():
    engine = CuttingEngine(version=1)
    runner = FunctionRollouts("megatron_dapo.rollouts.tool_agent:generate", {"tools": ["calculator"]}, 1, engine, TOK)
    item = PromptItem(0, TOK.encode("q="), "", "178377", "tool", [])
    calls = [
        {"input": "not-this-prompt", "response_ids": [9, 9], "logprobs": [0, 0], "versions": [0, 0], "finish": "stop"}
    ]
    [(_, _, sample, versions)] = runner.resume(
        [(item, 0, 0, calls)], SamplingParams(max_new_tokens=400), 1, frozenset({EOS})
    )
    assert 9 not in sample.response_ids and set(versions) == {1}
    assert runner.metrics(reset=True)["rollout/replay_diverged"] == 1.0


class OneTokenScorer:
    def score_batch(self, texts, items):
        return [{"score": 1.0, "acc": True} for _ in texts]

    def metrics(self, reset=False):
        return {}


def test_the_partial_schedule_carries_a_function_sample_and_trains_its_tokens_with_their_lags():
    from megatron_dapo.algo.batch import to_sequences
    from megatron_dapo.config.run_config import load_config

    cfg = load_config("tool_cpu", ["rollout.partial=true", "algo.group_size=1", "rollout.sampling.max_new_tokens=400",
                                   "algo.dynamic_sampling=false"])  # fmt: skip
    engine = CuttingEngine(version=0)
    engine.new_step, engine.step_restarts = (lambda: None), 0
    rollouts = FunctionRollouts(cfg.rollout.generate, {"tools": ["calculator"]}, 1, engine, TOK)
    from megatron_dapo.algo.sampling import DynamicSampler

    s = PartialSchedule(cfg, engine, None, DynamicSampler(1, 5, enabled=False), OneTokenScorer(), rollouts)
    s.version = 0
    prompt = TOK.encode("q=")
    slot = Slot()
    carried = Carried(PromptItem(0, prompt, "q=", "178377", "tool", []), [slot])
    engine.cut = 3
    s._step = {"resumed_samples": 0}
    s._round([carried], SamplingParams(max_new_tokens=400, seed=1))  # cut mid-turn: the slot keeps its calls
    assert not slot.finished and len(slot.calls) == 2 and carried.oldest_version() == 0
    state = Slot(**json.loads(json.dumps(slot.__dict__)))  # what a checkpoint holds and a resume rebuilds
    carried.slots = [state]
    s.version = engine.weight_version = 1
    judged, _, finished = s._round([carried], SamplingParams(max_new_tokens=400, seed=2))
    assert finished == 1 and s._step["resumed_samples"] == 1 and state.resumed == 1
    group = s._group(carried)
    n_call = len(TOK.encode(CALL)) + 1
    assert group.loss_masks[0] == [1] * n_call + [0] * len(INSERTED) + [1] * (len(TOK.encode(ANSWER)) + 1)
    assert group.token_lag[0] == [1] * n_call + [0] * len(INSERTED) + [1] * 3 + [0] * (len(TOK.encode(ANSWER)) + 1 - 3)
    [seq] = to_sequences([group], cfg)[0]
    assert seq.generated.tolist() == [bool(m) for m in group.loss_masks[0]]  # the tool's output: never trained
    assert seq.tis_mask.tolist() == [lag > 0 for lag in group.token_lag[0]]  # the old weights' tokens: TIS weighs them
