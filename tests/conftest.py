"""Suite-wide guard: every test module in the tree is collected when the whole suite runs.

pytest silently skips folders matched by ``norecursedirs`` (its default list holds ``dist`` and ``build``) and files
that do not match ``python_files``; a test folder dropped that way reports nothing, not even a skip. When a run
collects a directory (``make test`` collects ``tests/``), each ``test_*.py`` below it must have been visited.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
_visited: set[Path] = set()


def pytest_collect_file(file_path: Path, parent):
    if file_path.name.startswith("test_") and file_path.suffix == ".py":
        _visited.add(file_path.resolve())


def expected_test_files(roots: list[Path]) -> set[Path]:
    out = set()
    for root in roots:
        if root.is_dir():
            out |= {p.resolve() for p in root.rglob("test_*.py") if "__pycache__" not in p.parts}
    return out


def missing_test_files(roots: list[Path], visited: set[Path]) -> list[Path]:
    return sorted(expected_test_files(roots) - visited)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    roots = [Path(a.split("::")[0]).resolve() for a in config.args]
    roots = [r for r in roots if r.is_dir() and (r == TESTS or TESTS in r.parents)]
    missing = missing_test_files(roots, _visited)
    if missing:
        names = ", ".join(str(p.relative_to(TESTS.parent)) for p in missing)
        raise pytest.UsageError(f"test files in the tree were not collected (norecursedirs / python_files?): {names}")
