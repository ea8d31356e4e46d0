"""The rollout seam (rollout.generate) and the built-in tool agent: token in, token out across turns; the model's
tokens are the engine's, a tool's output is inserted with loss mask 0; the calculator; the tool-call format against
SGLang's own parser."""

from __future__ import annotations

import json
import threading
import time

import pytest

from megatron_dapo.data.dataset import PromptItem
from megatron_dapo.loop.rollout_fn import FunctionRollouts, RolloutAborted, RolloutClient
from megatron_dapo.rollouts import tool_agent
from megatron_dapo.rollouts.sandbox import isolation_problem
from megatron_dapo.rollouts.tools import ToolBudget, calculator, call_tool, make_tools
from megatron_dapo.types import RolloutInput, RolloutOutput, Sample, SamplingParams, TokenizerInfo

EOS = 1


class ByteTokenizer:
    """Bytes + 2 (0 pad, 1 eos): any text round-trips, the chat markers included."""

    eos_token_id, pad_token_id = EOS, 0

    def encode(self, text, add_special_tokens=False):
        return [b + 2 for b in text.encode()]

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i - 2 for i in ids if i >= 2).decode(errors="replace")


TOK = ByteTokenizer()
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821 * 37"}}\n</tool_call>'


class ScriptedEngine:
    """Answers a context by what it holds: no tool response yet -> a tool call; else the answer. Records every
    continuation it generated (ids and logprobs) and the contexts it was given."""

    def __init__(self, first=CALL, then="Answer: 178377", weight_version=3):
        self.first, self.then = first, then
        self.tokenizer = TokenizerInfo((EOS,), 0, decode=lambda ids: TOK.decode(ids))
        self.weight_version = weight_version
        self.generated, self.contexts, self.aborted = [], [], threading.Event()
        self.lock = threading.Lock()

    def generate_requests(self, requests, sampling):
        for i, r in enumerate(requests):
            context = TOK.decode(r.input_ids)
            text = self.then if "<tool_response>" in context else self.first
            ids = (TOK.encode(text) + [EOS])[: r.max_new_tokens]
            finish = "stop" if ids[-1] == EOS else "length"
            lps = [-0.01 * (k + 1) for k in range(len(ids))]
            with self.lock:
                self.generated.append((list(ids), lps))
                self.contexts.append(list(r.input_ids))
            yield Sample(list(r.input_ids), ids, lps, finish, prompt_index=i)

    def abort(self):
        self.aborted.set()


class Client:
    """The seam's client without threads: what a rollout function sees."""

    def __init__(self, engine, tokenizer=TOK):
        self.engine, self.tokenizer = engine, tokenizer

    def generate(self, input_ids, max_new_tokens, seed=None):
        from megatron_dapo.types import GenRequest

        return next(self.engine.generate_requests([GenRequest(list(input_ids), max_new_tokens, seed)], None))

    def encode(self, text):
        return self.tokenizer.encode(text)

    def decode(self, ids):
        return self.tokenizer.decode(ids)


@pytest.fixture
def isolated_sandbox():
    if (problem := isolation_problem()) is not None:
        pytest.skip(f"no sandbox isolation here: {problem}")


def item(tools=None, seed=7):
    prompt = TOK.encode("<|im_start|>user\nWhat is 4821*37?<|im_end|>\n<|im_start|>assistant\n")
    return RolloutInput(prompt, "", [], "178377", {"tools": tools} if tools else {}, 0, seed)


def test_a_two_turn_response_is_the_engines_tokens_and_the_tool_output_masked():
    engine = ScriptedEngine()
    inp = item()
    out = tool_agent.generate(Client(engine), inp, SamplingParams(max_new_tokens=400), tools=["calculator"])
    assert out.metrics.pop("tool_wall_s") >= 0
    assert out.metrics == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "used_tools": 1.0, "tool_refused": 0}
    (turn1, lp1), (turn2, lp2) = engine.generated
    inserted = TOK.encode(
        "\n<|im_start|>user\n<tool_response>\n178377\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert out.response_ids == turn1 + inserted + turn2  # the model's tokens exactly as generated: no re-tokenizing
    assert out.loss_mask == [1] * len(turn1) + [0] * len(inserted) + [1] * len(turn2)
    assert out.logprobs == lp1 + [0.0] * len(inserted) + lp2
    assert engine.contexts[1] == inp.prompt_ids + turn1 + inserted  # turn 2 continues the ids, not a re-render
    assert out.finish_reason == "stop"


def test_the_total_budget_and_the_turn_limit_hold():
    engine = ScriptedEngine(then=CALL)  # calls a tool every turn
    out = tool_agent.generate(Client(engine), item(), SamplingParams(max_new_tokens=4000), max_turns=3)
    assert out.metrics["turns"] == 3 and out.metrics["tool_calls"] == 2
    for budget in (50, 150, 190):  # cut: in turn 1, in the tool output, in the answer (the whole is 195)
        out = tool_agent.generate(Client(ScriptedEngine()), item(), SamplingParams(max_new_tokens=budget))
        assert len(out.response_ids) <= budget and out.finish_reason == "length"


def calls(*codes: str, name: str = "python") -> str:
    return "".join(f"<tool_call>\n{json.dumps({'name': name, 'arguments': {'code': c}})}\n</tool_call>" for c in codes)


def test_calls_over_the_turn_and_sample_budgets_are_refused_as_errors_the_model_reads(monkeypatch):
    """rollout.tools: a call over its budget is not run; the model reads which budget, the sample goes on."""
    ran = []
    monkeypatch.setitem(
        tool_agent._TOOLSETS, json.dumps([["echo"], None], sort_keys=True), {"echo": lambda a: ran.append(a) or "ok"}
    )
    turn = '<tool_call>\n{"name": "echo", "arguments": {}}\n</tool_call>'
    engine = ScriptedEngine(first=turn * 3, then=turn * 3)  # three calls every turn
    budget = ToolBudget(calls_per_turn=2, calls_per_sample=3, wall_s_per_sample=60)
    out = tool_agent.generate(
        Client(engine), item(), SamplingParams(max_new_tokens=4000), tools=["echo"], max_turns=3, tool_budget=budget
    )
    text = TOK.decode(out.response_ids)
    assert len(ran) == 3  # 2 in turn 1, 1 in turn 2; the rest refused
    assert text.count("over the budget of 2 tool calls per turn (rollout.tools.calls_per_turn)") == 1
    assert text.count("over the budget of 3 tool calls per sample (rollout.tools.calls_per_sample)") == 2
    assert out.metrics["tool_refused"] == 3 and out.metrics["tool_calls"] == 6 and out.metrics["turns"] == 3


def test_a_sample_holds_the_step_no_longer_than_its_tool_time(isolated_sandbox):
    """Each call is cut to the sample's remaining tool time, then calls are refused: four 30 s sleeps in a 3 s budget
    end in about 3 s."""
    engine = ScriptedEngine(
        first=calls(*["import time; time.sleep(30)"] * 2), then=calls("import time; time.sleep(30)")
    )
    budget = ToolBudget(calls_per_turn=8, calls_per_sample=8, wall_s_per_sample=3)
    start = time.monotonic()
    out = tool_agent.generate(
        Client(engine), item(), SamplingParams(max_new_tokens=4000), tools=["python"], max_turns=3,
        python={"wall_s": 30}, tool_budget=budget,
    )  # fmt: skip
    took = time.monotonic() - start
    text = TOK.decode(out.response_ids)
    assert took < 3 + 4, took  # the budget and a sandbox's start-up, not 4 x 30 s
    assert "error: timed out after" in text and "tool time are spent (rollout.tools.wall_s_per_sample)" in text
    assert out.metrics["tool_refused"] == 2 and 3 <= out.metrics["tool_wall_s"] < 3 + 2


def test_the_trainer_passes_rollout_tools_to_functions_that_take_a_budget():
    from megatron_dapo.config.run_config import ToolsConfig

    engine = ScriptedEngine(first=CALL * 3)
    args = {"tools": ["calculator"], "max_turns": 2}
    runner = FunctionRollouts(tool_agent.__name__ + ":generate", args, 2, engine, TOK, ToolsConfig(calls_per_turn=1))
    groups = list(runner.stream(prompt_items(1), SamplingParams(max_new_tokens=2000, seed=1), n=2))
    assert all("rollout.tools.calls_per_turn" in s.text for g in groups for s in g)
    assert runner.metrics()["rollout/tool_refused"] == 2.0


def test_bad_calls_become_error_text_the_model_reads():
    unknown = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'
    broken = "<tool_call>\n{not json}\n</tool_call>"
    for first, needle in ((unknown, "no tool named 'search'"), (broken, "not valid JSON")):
        engine = ScriptedEngine(first=first)
        out = tool_agent.generate(Client(engine), item(), SamplingParams(max_new_tokens=600), tools=["calculator"])
        assert out.metrics["tool_errors"] == 1 and needle in TOK.decode(out.response_ids)
    # a row's declared tools narrow what may run
    out = tool_agent.generate(
        Client(ScriptedEngine()),
        item(tools=[{"type": "function", "function": {"name": "python"}}]),
        SamplingParams(max_new_tokens=600),
        tools=["calculator", "python"],
    )
    assert "no tool named 'calculator'" in TOK.decode(out.response_ids)


def test_the_calculator_is_exact_and_bounded():
    assert calculator({"expression": "4821 * 37"}) == "178377"
    assert calculator({"expression": "2 ** 200"}) == str(2**200)
    assert calculator({"expression": "(7 + 5) / 4"}) == "3"
    assert calculator({"expression": "1 / 0"}) == "error: division by zero"
    assert calculator({"expression": "9 ** 9 ** 9"}).startswith("error: the result would have over")
    assert calculator({"expression": "__import__('os')"}).startswith("error: not arithmetic")
    assert call_tool(make_tools(["calculator"]), "calculator", {"expression": "2+2"}) == ("4", True)


def test_a_user_tool_plugs_in_by_reference(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text("def lookup(key):\n    return {'a': 'alpha'}.get(key, 'missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = make_tools([{"lookup": "my_tools:lookup"}])
    assert call_tool(tools, "lookup", {"key": "a"}) == ("alpha", True)
    out, ok = call_tool(tools, "lookup", {"nope": 1})
    assert not ok and out.startswith("error: TypeError")


def test_tool_calls_parse_as_sglangs_qwen25_parser_does():
    detector = pytest.importorskip("sglang.srt.function_call.qwen25_detector")
    protocol = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
    tools = [
        protocol.Tool(type="function", function=protocol.Function(name=n, parameters={"type": "object"}))
        for n in ("calculator", "python")
    ]
    texts = [
        "Let me compute.\n" + CALL,
        CALL + "\n" + '<tool_call>\n{"name": "python", "parameters": {"code": "print(1)"}}\n</tool_call>',
        "No call here.",
        '<tool_call>\n[{"name": "calculator", "arguments": {"expression": "1+1"}}]\n</tool_call>',
    ]
    for text in texts:
        theirs = detector.Qwen25Detector().detect_and_parse(text, tools).calls
        ours = tool_agent.parse_tool_calls(text)
        assert [(c.name, json.loads(c.parameters)) for c in theirs] == ours, text


def prompt_items(n):
    return [PromptItem(i, TOK.encode(f"q{i}="), f"q{i}=", "178377", "tool", []) for i in range(n)]


def test_the_seam_turns_rollout_functions_into_groups_with_their_masks(tmp_path, monkeypatch):
    engine = ScriptedEngine()
    runner = FunctionRollouts("megatron_dapo.rollouts.tool_agent:generate", {"tools": ["calculator"]}, 4, engine, TOK)
    groups = list(runner.stream(prompt_items(3), SamplingParams(max_new_tokens=400, seed=1), n=2))
    assert sorted(g[0].prompt_index for g in groups) == [0, 1, 2]
    for g in groups:
        assert [s.sample_index for s in g] == [0, 1] and all(s.weight_version == 3 for s in g)
        assert all(0 in s.loss_mask and s.text.endswith("Answer: 178377") for s in g)
    metrics = runner.metrics(reset=True)
    assert metrics.pop("rollout/tool_wall_s") >= 0
    assert metrics == {
        "rollout/turns": 2.0,
        "rollout/tool_calls": 1.0,
        "rollout/tool_errors": 0.0,
        "rollout/used_tools": 1.0,
        "rollout/tool_refused": 0.0,
    }


def test_an_abort_drops_the_unfinished_samples_and_a_raising_function_names_itself(tmp_path, monkeypatch):
    (tmp_path / "my_rollouts.py").write_text(
        "import time\n"
        "from megatron_dapo.types import RolloutOutput\n"
        "def slow(client, item, sampling):\n"
        "    if item.metadata['index'] > 0:\n"
        "        time.sleep(0.3)\n"
        "    s = client.generate(item.prompt_ids, 8, seed=item.seed)\n"
        "    return RolloutOutput(s.response_ids, s.logprobs, None, s.finish_reason)\n"
        "def broken(client, item, sampling):\n"
        "    raise KeyError('tools')\n"
        "def wrong_type(client, item, sampling):\n"
        "    return [1, 2]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    runner = FunctionRollouts("my_rollouts:slow", {}, 8, ScriptedEngine(), TOK)
    stream = runner.stream(prompt_items(6), SamplingParams(max_new_tokens=8), n=1)
    first = next(stream)
    assert first[0].prompt_index == 0
    runner.abort()  # dynamic sampling has its groups
    stream.close()  # returns once the threads are done: the sleeping ones get RolloutAborted
    client = RolloutClient(ScriptedEngine(), TOK, SamplingParams(), runner._cancelled)
    with pytest.raises(RolloutAborted):  # a function that calls the engine after the abort is stopped there
        client.generate([5], 4)
    client.close()
    for name, needle in (("broken", "KeyError: 'tools'"), ("wrong_type", "returned list, not a RolloutOutput")):
        runner = FunctionRollouts(f"my_rollouts:{name}", {}, 2, ScriptedEngine(), TOK)
        with pytest.raises((RuntimeError, TypeError), match=needle) as e:
            list(runner.stream(prompt_items(2), SamplingParams(max_new_tokens=8), n=1))
        assert name in str(e.value) or "RolloutOutput" in str(e.value)


def test_a_rollout_output_that_does_not_line_up_is_refused():
    with pytest.raises(ValueError, match="2 logprobs for 3 response tokens"):
        RolloutOutput([1, 2, 3], [0.0, 0.0])
    with pytest.raises(ValueError, match="a loss mask of 1 for 2"):
        RolloutOutput([1, 2], [0.0, 0.0], [1])


def test_single_turn_through_the_seam_equals_the_engines_own_generation():
    """The default rollout written as a function gives the engine's tokens for the same seeds (a real HF engine)."""
    from tests.unit.test_rollout_hf import PROMPTS, make_engine

    engine, _ = make_engine(tok=TokenizerInfo((3,), 0))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seed=123)
    fast = engine.generate(PROMPTS, sampling, n=3)
    items = [PromptItem(i, p, "", "", "x", []) for i, p in enumerate(PROMPTS)]
    runner = FunctionRollouts("megatron_dapo.rollouts.single_turn:generate", {}, 8, engine, None)
    seam = sorted(
        (s for g in runner.stream(items, sampling, n=3) for s in g), key=lambda s: (s.prompt_index, s.sample_index)
    )
    assert [s.response_ids for s in seam] == [s.response_ids for s in fast]
    assert [s.finish_reason for s in seam] == [s.finish_reason for s in fast]
    for a, b in zip(seam, fast):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.loss_mask is None


def test_rollout_function_settings_are_checked_up_front():
    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.config.typed_yaml import ConfigError

    cfg = load_config(
        "demo_cpu", ["rollout.generate=megatron_dapo.rollouts.single_turn:generate", "rollout.partial=true"]
    )
    assert cfg.rollout.partial  # resumed mid-turn (tests/unit/test_partial_rollout_fn.py)
    with pytest.raises(ConfigError, match="rollout.generate_concurrency = 4 would be ignored: rollout.generate = null"):
        load_config("demo_cpu", ["rollout.generate_concurrency=4"])
    with pytest.raises(ConfigError, match=r"rollout.generate_args = \[1\]: expected a mapping"):
        load_config("demo_cpu", ["rollout.generate=m:f", "rollout.generate_args=[1]"])
    cfg = load_config("tool_cpu", ["rollout.generate_args.max_turns=3"])
    assert cfg.rollout.generate_args["max_turns"] == 3 and cfg.rollout.generate_args["tools"] == ["calculator"]
