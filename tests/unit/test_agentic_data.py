"""The agentic data format: the DAPO schema plus a ``tools`` column; the example file tools/prepare_data.py writes
loads through ``datasets``, its declarations reach the chat template and the tool agent, and a bad one is named."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo.data.dataset import DataError, PromptDataset, check_row
from megatron_dapo.loop.rollout_fn import FunctionRollouts
from megatron_dapo.reward.registry import RewardScorer
from megatron_dapo.types import SamplingParams
from tests.helpers import REPO, make_char_hf_tokenizer, repo_pythonpath
from tests.unit.test_tool_agent import TOK, ScriptedEngine

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    out = tmp_path_factory.mktemp("agentic") / "tool_arith.parquet"
    proc = subprocess.run(
        [sys.executable, "tools/prepare_data.py", "--tool-example", str(out), "--rows", "8"],
        cwd=REPO,
        env={"PYTHONPATH": repo_pythonpath(), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(make_char_hf_tokenizer(tmp_path_factory.mktemp("tok")))
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def test_the_example_loads_and_its_tools_reach_the_prompt_and_the_item(example, tokenizer):
    ds = PromptDataset.from_files([str(example)], tokenizer, max_prompt_len=2048)
    item = ds.items[0]
    assert '"name": "calculator"' in item.prompt_text and item.prompt_text.startswith("<|im_start|>system\n# Tools")
    assert item.extra["tools"][0]["function"]["name"] == "calculator"
    a, b = item.extra["extra_info"]["a"], item.extra["extra_info"]["b"]
    assert item.ground_truth == str(a * b) and f"What is {a} * {b}?" in item.prompt_text


def test_the_tool_agent_answers_an_example_row_and_the_reward_scores_it(example, tokenizer):
    item = PromptDataset.from_files([str(example)], tokenizer, max_prompt_len=2048).items[0]
    a, b = item.extra["extra_info"]["a"], item.extra["extra_info"]["b"]
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}\n</tool_call>'
    engine = ScriptedEngine(first=call, then=f"Answer: {a * b}")
    item.prompt_ids = TOK.encode(item.prompt_text)  # the scripted engine speaks bytes
    runner = FunctionRollouts("megatron_dapo.rollouts.tool_agent:generate", {"tools": ["calculator"]}, 2, engine, TOK)
    (group,) = runner.stream([item], SamplingParams(max_new_tokens=600), n=1)
    assert f"<tool_response>\n{a * b}\n</tool_response>" in group[0].text
    (result,) = RewardScorer().score_batch([group[0].text], [item])
    assert result["acc"] and result["score"] == 1.0


def test_a_bad_tools_column_is_named(tmp_path, tokenizer):
    row = {
        "prompt": [{"role": "user", "content": "q"}],
        "reward_model": {"ground_truth": "1", "style": "rule"},
        "data_source": "tool_arith",
        "tools": "[{not json",
    }
    assert check_row(row).startswith("tools: not valid JSON")
    assert (
        check_row({**row, "tools": json.dumps([{"type": "function", "function": {}}])})
        == "tools: [0] has no function name"
    )
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    with pytest.raises(DataError, match=r"bad.parquet row 0: tools: not valid JSON"):
        PromptDataset.from_files([str(path)], tokenizer, max_prompt_len=64)
