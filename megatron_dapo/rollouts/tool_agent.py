"""A multi-turn agent that calls tools, as a rollout function: token in, token out across turns.

    rollout:
      generate: megatron_dapo.rollouts.tool_agent:generate
      generate_args: {tools: [calculator, python], max_turns: 4, python: {wall_s: 10, memory_mb: 2048}}

Each turn the engine continues the context (prompt + everything so far, as token ids: what the model generated is
never re-tokenized). When a turn ends (EOS or a stop token) its text is searched for tool calls in the Qwen / Hermes
format SGLang's parser reads (sglang 0.5.23 srt/function_call/qwen25_detector.py:38-72 and base_format_detector.py:
77-101: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, ``parameters`` taken for
``arguments``); each is run and its output appended as the chat template writes tool messages (Qwen2.5: a user turn of
``<tool_response>`` blocks, then a new assistant turn). Appended tokens carry loss mask 0 and logprob 0.0: they are in
the context of later turns, never trained, and left out of the entropy, the logprob gap and the overlong penalty's
length (which counts the model's own tokens: it exists to teach the model to be brief, and a tool's output is not the
model's to shorten). The whole response (model and tool tokens) stays within ``rollout.sampling.max_new_tokens``, so it
fits the trainer's sequence length; a tool output that would overflow it is cut and the sample ends as 'length'.

Budgets: ``rollout.tools`` (calls per turn and per sample, tool seconds per sample; rollouts/tools.py ToolBudget),
passed by the trainer as ``tool_budget``; a refused call is an error message the model reads, counted as
``rollout/tool_refused``.

Tools: ``tools`` in generate_args (``calculator``, ``python``, or ``{name: "package.module:function"}``); a row's
``tools`` field (OpenAI function declarations, as the data format and chat templates carry them) narrows them to the
ones it declares. The markers are arguments too, for a chat template that writes them differently.
"""

from __future__ import annotations

import json
import re

from megatron_dapo.rollouts.tools import ToolBudget, make_tools
from megatron_dapo.types import RolloutInput, RolloutOutput, SamplingParams, sample_seed

QWEN = {
    "call_open": "<tool_call>\n",
    "call_close": "\n</tool_call>",
    "tool_turn_open": "\n<|im_start|>user",
    "tool_response": "\n<tool_response>\n{output}\n</tool_response>",
    "tool_turn_close": "<|im_end|>\n<|im_start|>assistant\n",
}
_TOOLSETS: dict[str, dict] = {}  # per process: generate_args -> tools (made once)


def parse_tool_calls(text: str, call_open: str = QWEN["call_open"], call_close: str = QWEN["call_close"]) -> list:
    """The calls in a turn's text: ``(name, arguments)``, or ``(None, error)`` for a block that is not a call."""
    calls = []
    for body in re.findall(re.escape(call_open) + "(.*?)" + re.escape(call_close), text, re.DOTALL):
        try:
            parsed = json.loads(body.strip())
        except json.JSONDecodeError as e:
            calls.append((None, f"error: the tool call is not valid JSON ({e.msg})"))
            continue
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or not call.get("name"):
                calls.append((None, "error: a tool call needs a 'name'"))
            else:
                calls.append((call["name"], call.get("arguments", call.get("parameters", {}))))
    return calls


def _encode(client, text: str) -> list[int]:
    """The tool turn's ids; a tokenizer that cannot spell some character of a tool's output (a small char tokenizer
    meeting an error message) drops that character rather than ending the run."""
    try:
        return client.encode(text)
    except ValueError:
        ids = []
        for ch in text:
            try:
                ids += client.encode(ch)
            except ValueError:
                continue
        return ids


def _toolset(tools: list, python: dict | None) -> dict:
    key = json.dumps([tools, python], sort_keys=True, default=str)
    if key not in _TOOLSETS:
        _TOOLSETS[key] = make_tools(tools, python)
    return _TOOLSETS[key]


def generate(
    client,
    item: RolloutInput,
    sampling: SamplingParams,
    tools: list | None = None,
    max_turns: int = 4,
    python: dict | None = None,
    tool_budget: ToolBudget | None = None,
    **markers: str,
) -> RolloutOutput:
    fmt = {**QWEN, **markers}
    if set(fmt) != set(QWEN):
        raise TypeError(f"tool_agent: unknown arguments {sorted(set(fmt) - set(QWEN))}")
    available = _toolset(list(tools if tools is not None else ["calculator", "python"]), python)
    declared = item.metadata.get("tools")
    if declared:  # the row's declarations narrow the tools to those it names
        names = {d.get("function", d).get("name") for d in declared if isinstance(d, dict)}
        available = {k: v for k, v in available.items() if k in names}
    budget = sampling.max_new_tokens
    tool_budget = tool_budget or ToolBudget()  # the trainer passes rollout.tools; these are its defaults
    response, logprobs, mask = [], [], []
    turns = calls = errors = 0
    finish = "stop"
    while True:
        turns += 1
        seed = item.seed if turns == 1 or item.seed is None else sample_seed(item.seed, turns, item.sample_index)
        s = client.generate(item.prompt_ids + response, budget - len(response), seed=seed)
        response += s.response_ids
        logprobs += s.logprobs
        mask += [1] * len(s.response_ids)
        if s.finish_reason != "stop":
            finish = s.finish_reason
            break
        found = parse_tool_calls(client.decode(s.response_ids), fmt["call_open"], fmt["call_close"])
        if not found or turns >= max_turns:
            break
        outputs = []
        tool_budget.new_turn()
        for name, arguments in found:
            out, ok = (arguments, False) if name is None else tool_budget.call(available, name, arguments)
            calls += 1
            errors += int(not ok)
            outputs.append(out)
        text = fmt["tool_turn_open"]
        text += "".join(fmt["tool_response"].format(output=o) for o in outputs) + fmt["tool_turn_close"]
        ids = _encode(client, text)
        room = budget - len(response)
        if len(ids) >= room:  # no room left for the model to answer: the sample ends here
            cut = ids[:room]
            response += cut
            logprobs += [0.0] * len(cut)
            mask += [0] * len(cut)
            finish = "length"
            break
        response += ids
        logprobs += [0.0] * len(ids)
        mask += [0] * len(ids)
    metrics = {"turns": turns, "tool_calls": calls, "tool_errors": errors, "used_tools": float(calls > 0),
               "tool_refused": tool_budget.refused, "tool_wall_s": tool_budget.wall_s}  # fmt: skip
    return RolloutOutput(response, logprobs, mask, finish, metrics=metrics)
