"""No import cycles among megatron_dapo's modules (issue 14: the loop, evaluation and rollout each own their part).

The graph is read from the source: every ``import`` of a megatron_dapo module, at module level or inside a function
(a lazy import closes a cycle as surely, only later), except under ``if TYPE_CHECKING:``. Then every module is imported
in a fresh interpreter, so the graph's modules are the ones that load.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

PACKAGE = REPO / "megatron_dapo"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


class _Imports(ast.NodeVisitor):
    def __init__(self, name: str, is_package: bool):
        self.name, self.package = name, name if is_package else name.rpartition(".")[0]
        self.found: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):  # annotations only: never executed
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.update(alias.name for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([node.module] if node.module else []))
        self.found.add(base)
        self.found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        v = _Imports(name, path.name == "__init__.py")
        v.visit(ast.parse(path.read_text()))
        graph[name] = {m for m in v.found if m in mods and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_sees_lazy_imports():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_megatron_dapo_modules():
    graph = import_graph()
    # the pairs issue 14 named, and the rest of the package
    for a, b in [("megatron_dapo.loop.evaluate", "megatron_dapo.loop.trainer"),
                 ("megatron_dapo.engines.sglang.client", "megatron_dapo.sync.weight_sync"),
                 ("megatron_dapo.engines.sglang.sync", "megatron_dapo.sync.weight_sync")]:  # fmt: skip
        assert not (b in graph[a] and a in graph[b]), (a, b)
    assert "megatron_dapo.loop.trainer" not in graph["megatron_dapo.loop.evaluate"]
    assert cycles(graph) == []


@pytest.mark.timeout(300)
def test_every_module_imports_in_a_fresh_interpreter():
    names = [n for n in _modules() if n != "megatron_dapo"]
    code = (
        "import importlib, sys, traceback\nbad = []\n"
        f"for name in {names!r}:\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except Exception as e:\n        bad.append(f'{name}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad)); sys.exit(1 if bad else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
