"""A task a small model needs a tool for (the tool agent's CPU example): a 3-digit times a 2-digit number.

    Q: 347*58=   →   <tool_call>\\n{"name": "calculator", "arguments": {"expression": "347*58"}}\\n</tool_call><eos>
                     \\n<tool_response>\\n20126\\n</tool_response>\\n          (inserted by the tool agent: loss mask 0)
                     Answer: 20126<eos>

A 1M-parameter model cannot multiply in its head, but it can copy digits: into the call, and from the tool's output
into the answer. The warm start teaches both ways of answering, half the train rows written out with the tool and half
answered directly (``extra_info.solution_parts``, the tool's output not trained); RL then has to find that the tool
pays. The rows declare the calculator (``tools``), so the agent allows it and nothing else. The char tokenizer
``char:tools`` spells the calls; the agent's markers for this compact format are ``AGENT_ARGS``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from megatron_dapo.data.dataset import PromptDataset

DATA_SOURCE = "synthetic/tool_mul"
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}\n</tool_call>'
RESPONSE = "\n<tool_response>\n{output}\n</tool_response>\n"
# rollout.generate_args for this format: the model's turn ends at its eos; the tool's output follows directly
AGENT_ARGS = {"tools": ["calculator"], "max_turns": 2, "tool_turn_open": "", "tool_response": RESPONSE,
              "tool_turn_close": ""}  # fmt: skip
CALCULATOR = {
    "type": "function",
    "function": {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {}}}},
}
LOW, HIGH = (100, 999), (10, 99)


def tool_mul_solution(a: int, b: int, with_tool: bool) -> list[list]:
    """The warm start's response as ``[text, trained]`` parts (the tool's output: not trained)."""
    answer = [f"Answer: {a * b}", 1]
    if not with_tool:
        return [answer]
    return [[CALL.format(a=a, b=b) + "<eos>", 1], [RESPONSE.format(output=a * b), 0], answer]


def tool_mul_row(a: int, b: int, index: int, split: str, with_tool: bool = True) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{a}*{b}="}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a * b)},
        "tools": json.dumps([CALCULATOR]),
        "extra_info": {"index": index, "split": split, "solution_parts": tool_mul_solution(a, b, with_tool)},
    }


def tool_mul_splits(train_size: int, eval_size: int, seed: int, direct_frac: float = 0.5):
    """Train and eval rows over disjoint problems; ``direct_frac`` of the train rows answered without the tool."""
    rng = np.random.default_rng(seed)
    problems = [(a, b) for a in range(LOW[0], LOW[1] + 1) for b in range(HIGH[0], HIGH[1] + 1)]
    if not 0 < eval_size < len(problems):
        raise ValueError(f"synthetic eval_size = {eval_size}: must be in [1, {len(problems) - 1}]")
    order = rng.permutation(len(problems))
    held, rest = order[:eval_size], order[eval_size:]
    evals = [tool_mul_row(*problems[i], k, "eval") for k, i in enumerate(held)]
    train_idx = np.resize(rng.permutation(rest), train_size)
    direct = rng.random(train_size) < direct_frac
    train = [tool_mul_row(*problems[i], k, "train", not direct[k]) for k, i in enumerate(train_idx)]
    return train, evals


def make_tool_mul_datasets(
    tokenizer: Any, train_size: int, eval_size: int, seed: int, max_prompt_len: int, apply_chat_template: bool = True
) -> tuple[PromptDataset, PromptDataset]:
    train, evals = tool_mul_splits(train_size, eval_size, seed)
    return (
        PromptDataset.from_rows(train, tokenizer, max_prompt_len, apply_chat_template, name="synthetic tool_mul train"),
        PromptDataset.from_rows(evals, tokenizer, max_prompt_len, apply_chat_template, name="synthetic tool_mul eval"),
    )
