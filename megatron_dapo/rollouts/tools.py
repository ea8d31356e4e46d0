"""Tools a rollout's model may call: a calculator, a sandboxed Python interpreter, and the user's own.

    tools = make_tools(["calculator", "python", {"lookup": "my_pkg.tools:lookup"}], python={"wall_s": 5})
    tools["calculator"]({"expression": "4821 * 37"})   # "178377"

A tool takes the call's ``arguments`` (a dict) and returns text: the tool's output the model reads next. A failure is
text too (``error: ...``), so a bad call teaches the model instead of stopping the run. ``TOOL_SCHEMAS`` holds the
declarations a chat template shows the model (OpenAI function format, as ``apply_chat_template(tools=...)`` takes).
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from megatron_dapo.config.plugins import load_callable
from megatron_dapo.rollouts.sandbox import SandboxLimits, SandboxUnavailable, run_python

Tool = Callable[[dict], str]

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
        return run_python(code, limits, allow_unisolated).output

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
