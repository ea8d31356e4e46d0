"""Tools a rollout's model may call: a calculator, a sandboxed Python interpreter, and the user's own.

    tools = make_tools(["calculator", "python", {"lookup": "my_pkg.tools:lookup"}], python={"wall_s": 5})
    tools["calculator"]({"expression": "4821 * 37"})   # "178377"

A tool takes the call's ``arguments`` (a dict) and returns text: the tool's output the model reads next. A failure is
text too (``error: ...``), so a bad call teaches the model instead of stopping the run. ``TOOL_SCHEMAS`` holds the
declarations a chat template shows the model (OpenAI function format, as ``apply_chat_template(tools=...)`` takes).

``ToolBudget`` is one sample's share (``rollout.tools``): calls per turn, calls per sample and tool wall-clock seconds
per sample. A call over it is not run: the model reads an error saying which budget, and the sample goes on. The
sandbox's wall-clock limit is cut to what the sample has left, so no sample holds a step longer than its budget (a
user's own tool runs in the trainer's process and cannot be cut short: its time is counted and refuses later calls).
"""

from __future__ import annotations

import ast
import contextvars
import logging
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_dapo.config.plugins import load_callable
from megatron_dapo.rollouts.sandbox import SandboxLimits, SandboxUnavailable, isolation_path, run_python

Tool = Callable[[dict], str]
log = logging.getLogger(__name__)
# the running call's deadline (time.monotonic), set by ToolBudget.call: the sandbox ends by it
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("tool_deadline", default=None)

TOOL_SCHEMAS = {
    "calculator": {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression exactly (+ - * / // % ** and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 4821 * 37"}},
                "required": ["expression"],
            },
        },
    },
    "python": {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code in a sandbox and return what it prints.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the program; print the result"}},
                "required": ["code"],
            },
        },
    },
}

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_OUTPUT_CHARS = 2000  # what a tool's output may add to the context
MAX_DIGITS = 1000  # no operand or result beyond this many digits (a calculator, not a denial of service)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * len(str(abs(int(left)))) > MAX_DIGITS:
            raise ValueError(f"the result would have over {MAX_DIGITS} digits")
        value = _OPS[type(node.op)](left, right)
        if isinstance(value, int) and len(str(abs(value))) > MAX_DIGITS:
            raise ValueError(f"the result has over {MAX_DIGITS} digits")
        return value
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def calculator(arguments: dict) -> str:
    expression = str(arguments.get("expression", ""))
    if len(expression) > 500:
        return "error: the expression is over 500 characters"
    try:
        value = _evaluate(ast.parse(expression, mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def python_tool(limits: SandboxLimits, allow_unisolated: bool = False) -> Tool:
    def run(arguments: dict) -> str:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return "error: no code (the call needs a 'code' argument)"
        return run_python(code, limits, allow_unisolated, deadline=_DEADLINE.get()).output

    return run


def make_tools(names: list, python: dict | None = None) -> dict[str, Tool]:
    """Tools by name (``calculator``, ``python``) or ``{name: "package.module:function"}`` for the user's own."""
    python = dict(python or {})
    allow = bool(python.pop("allow_unisolated", False))
    tools: dict[str, Tool] = {}
    for entry in names:
        if isinstance(entry, dict):
            for name, spec in entry.items():
                tools[str(name)] = _user_tool(spec, f"rollout.generate_args.tools.{name}")
        elif entry == "calculator":
            tools["calculator"] = calculator
        elif entry == "python":
            tools["python"] = python_tool(SandboxLimits(**python), allow)
            log.info("python tool: sandbox with %s", isolation_path())
        else:
            raise ValueError(
                f"tool {entry!r}: unknown; built in: calculator, python (or {{name: 'package.module:function'}})"
            )
    return tools


def _user_tool(spec: str, key: str) -> Tool:
    fn = load_callable(spec, key)

    def run(arguments: dict) -> str:
        return str(fn(**arguments))

    return run


def schemas(tools: dict[str, Tool], declared: list | None = None) -> list[dict]:
    """The declarations to show the model: the row's own when given, else the built-in ones of these tools."""
    if declared:
        return list(declared)
    return [TOOL_SCHEMAS[name] for name in tools if name in TOOL_SCHEMAS]


def call_tool(tools: dict[str, Tool], name: Any, arguments: Any) -> tuple[str, bool]:
    """(output, ok): the tool's text, or an error message the model reads."""
    if name not in tools:
        return f"error: no tool named {name!r} (tools: {', '.join(tools) or 'none'})", False
    if not isinstance(arguments, dict):
        return f"error: arguments must be an object, got {type(arguments).__name__}", False
    try:
        out = tools[name](arguments)
    except SandboxUnavailable:  # a setting to change, not the model's mistake: the run stops and says which
        raise
    except Exception as e:  # noqa: BLE001 - the model reads the failure
        return f"error: {type(e).__name__}: {e}"[:500], False
    if len(out) > MAX_OUTPUT_CHARS:
        out = out[:MAX_OUTPUT_CHARS] + f"\n[output cut at {MAX_OUTPUT_CHARS} characters]"
    return out, not out.startswith("error:") and "\nerror: " not in out


@dataclass
class ToolBudget:
    """One sample's tool budget (``rollout.tools``); ``call`` runs a tool within it. Counts what it refused."""

    calls_per_turn: int = 8
    calls_per_sample: int = 32
    wall_s_per_sample: float = 120.0
    calls: int = field(default=0, init=False)
    turn_calls: int = field(default=0, init=False)
    refused: int = field(default=0, init=False)
    wall_s: float = field(default=0.0, init=False)  # tool time spent so far

    def new_turn(self) -> None:
        self.turn_calls = 0

    def over(self) -> str | None:
        """Why the next call would be refused, or None."""
        if self.turn_calls >= self.calls_per_turn:
            return f"over the budget of {self.calls_per_turn} tool calls per turn (rollout.tools.calls_per_turn)"
        if self.calls >= self.calls_per_sample:
            return f"over the budget of {self.calls_per_sample} tool calls per sample (rollout.tools.calls_per_sample)"
        if self.wall_s >= self.wall_s_per_sample:
            return (f"the sample's {self.wall_s_per_sample:g} s of tool time are spent "
                    "(rollout.tools.wall_s_per_sample)")  # fmt: skip
        return None

    def call(self, tools: dict[str, Tool], name: Any, arguments: Any) -> tuple[str, bool]:
        """``call_tool`` within the budget: a refused call is an error the model reads (not run, not counted)."""
        if (why := self.over()) is not None:
            self.refused += 1
            return f"error: not run: {why}; answer with what you have", False
        self.calls += 1
        self.turn_calls += 1
        start = time.monotonic()
        token = _DEADLINE.set(start + self.wall_s_per_sample - self.wall_s)
        try:
            return call_tool(tools, name, arguments)
        finally:
            _DEADLINE.reset(token)
            self.wall_s += time.monotonic() - start
