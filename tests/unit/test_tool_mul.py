"""The tool agent's CPU task: problems held out, half the warm-start rows written with the tool (its output masked),
the char:tools tokenizer spells the whole exchange, and the agent runs it with that tokenizer's markers."""

from __future__ import annotations

from megatron_dapo.data.dataset import PromptDataset
from megatron_dapo.data.synthetic import supervised_target
from megatron_dapo.data.tokenizer import load_tokenizer
from megatron_dapo.data.tool_mul import AGENT_ARGS, CALL, tool_mul_splits
from megatron_dapo.reward.registry import RewardScorer
from megatron_dapo.rollouts import tool_agent
from megatron_dapo.types import RolloutInput, Sample, SamplingParams
from tests.unit.test_tool_agent import Client

TOK = load_tokenizer("char:tools")


def test_splits_are_disjoint_and_half_the_warm_start_uses_the_tool():
    train, evals = tool_mul_splits(2000, 100, seed=3)
    held = {r["prompt"][0]["content"] for r in evals}
    assert len(held) == 100 and not held & {r["prompt"][0]["content"] for r in train}
    with_tool = sum(len(r["extra_info"]["solution_parts"]) == 3 for r in train) / len(train)
    assert 0.45 < with_tool < 0.55
    assert tool_mul_splits(50, 10, seed=3) == tool_mul_splits(50, 10, seed=3)


def test_the_warm_start_target_trains_the_call_and_the_answer_not_the_tools_output():
    train, _ = tool_mul_splits(20, 5, seed=0)
    row = next(r for r in train if len(r["extra_info"]["solution_parts"]) == 3)
    ids, mask = supervised_target(TOK, row["reward_model"]["ground_truth"], {"extra_info": row["extra_info"]})
    text = TOK.decode(ids)
    trained = TOK.decode([i for i, m in zip(ids, mask) if m])
    assert text.startswith("<tool_call>\n") and text.endswith(f"Answer: {row['reward_model']['ground_truth']}<eos>")
    assert "<tool_response>" in text and "<tool_response>" not in trained
    assert trained.endswith(f"</tool_call><eos>Answer: {row['reward_model']['ground_truth']}<eos>")


class CharEngine:
    """Writes the call for the prompt's factors, then copies the tool's product: a policy that learned the task."""

    def __init__(self):
        from megatron_dapo.types import TokenizerInfo

        self.tokenizer = TokenizerInfo((TOK.eos_token_id,), 0, decode=lambda ids: TOK.decode(ids, True))
        self.weight_version = 0

    def generate_requests(self, requests, sampling):
        for i, r in enumerate(requests):
            context = TOK.decode(r.input_ids)
            if "<tool_response>" in context:
                text = "Answer: " + context.split("<tool_response>\n")[1].split("\n")[0]
            else:
                a, b = context.split("Q: ")[1].rstrip("=").split("*")
                text = CALL.format(a=a, b=b)
            ids = TOK.encode(text) + [TOK.eos_token_id]
            yield Sample(list(r.input_ids), ids, [-0.1] * len(ids), "stop", prompt_index=i)


def test_the_agent_runs_the_task_with_the_char_tokenizer_and_scores():
    _, evals = tool_mul_splits(10, 5, seed=1)
    ds = PromptDataset.from_rows(evals, TOK, max_prompt_len=16)
    for item in ds.items:
        inp = RolloutInput(item.prompt_ids, item.prompt_text, item.messages, item.ground_truth, item.extra, 0, 1)
        out = tool_agent.generate(Client(CharEngine(), TOK), inp, SamplingParams(max_new_tokens=160), **AGENT_ARGS)
        text = TOK.decode(out.response_ids, skip_special_tokens=True)
        assert out.metrics["tool_calls"] == 1 and out.metrics["tool_errors"] == 0, text
        assert RewardScorer().score(text, item)["acc"], text
        inserted = TOK.decode([i for i, m in zip(out.response_ids, out.loss_mask) if m == 0])
        assert inserted == f"\n<tool_response>\n{item.ground_truth}\n</tool_response>\n"


def test_the_sglang_server_gets_no_hf_tokenizer_for_a_named_char_tokenizer():
    """`char:tools` is no HF tokenizer: the server is started with --skip-tokenizer-init (ids in, ids out), as for `char`.
    (tool_cpu_sglang once died at start-up: SGLang asked the hub for a repo named 'char:tools'.)"""
    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.engines.sglang.server import server_args

    args = server_args(load_config("tool_cpu_sglang"))
    assert "--skip-tokenizer-init" in args and "--tokenizer-path" not in args
