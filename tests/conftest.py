"""Suite-wide: every test module in the tree is collected when the whole suite runs; the groups pytest-xdist keeps.

pytest silently skips folders matched by ``norecursedirs`` (its default list holds ``dist`` and ``build``) and files
that do not match ``python_files``; a test folder dropped that way reports nothing, not even a skip. When a run
collects a directory (``make test`` collects ``tests/``), each ``test_*.py`` below it must have been visited.

``make test`` runs on ``PYTEST_WORKERS`` (2) pytest-xdist workers (``-n N --dist loadscope``; 0: one process): the
Slurm folder mostly waits, beside the others' CPU work. The scheduler below keeps together what a
fixture builds once: tests/sglang shares one SGLang server per session and tests/slurm one local Slurm, so each of
those folders runs on one worker; any other file keeps its module-scoped fixtures on one worker. (xdist's own
``loadgroup`` cannot do it on pytest 9.2: its group suffix goes to ``item._nodeid``, which pytest 9.2's
``Node.nodeid`` no longer reads, so every test lands in no group.)
"""

from __future__ import annotations

import json
import os
import resource
import time
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


SESSION_FOLDERS = ("sglang", "slurm", "vllm")  # folders whose tests share a session fixture: one worker each


def worker_scope(nodeid: str) -> str:
    """The unit of work one xdist worker takes whole: ``tests/<folder>`` for SESSION_FOLDERS, else the test's file."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    if len(parts) > 2 and parts[0] == TESTS.name and parts[1] in SESSION_FOLDERS:
        return "/".join(parts[:2])
    return path


# the order scopes are handed out in (longest first, so no long test is left for the end): the shared-fixture folders,
# then the files that start whole trainers or torchruns, then the unit tests, many and short
HAND_OUT_ORDER = ("sglang", "slurm", "vllm", "e2e", "dist")


def hand_out_rank(nodeid: str) -> int:
    parts = nodeid.split("::", 1)[0].split("/")
    folder = parts[1] if len(parts) > 2 and parts[0] == TESTS.name else ""
    return HAND_OUT_ORDER.index(folder) if folder in HAND_OUT_ORDER else len(HAND_OUT_ORDER)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a venv without pytest-xdist still collects
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with :func:`worker_scope` as the scope, handed out in the collection's order (which
    ``pytest_collection_modifyitems`` sorts by :func:`hand_out_rank`), not xdist's most-tests-first."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class FolderScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_scope(nodeid)

    return FolderScheduling(config, log)


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
    if hasattr(config, "workerinput"):  # an xdist worker: the collection order is the order work is handed out in
        items.sort(key=lambda item: hand_out_rank(item.nodeid))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``DAPO_TEST_CPU_LOG=FILE``: per test, its wall-clock seconds and the CPU seconds of this process and of the
    children it waited for (torchrun, ``dapo train``, servers stopped), one JSON line each: where the suite's time is
    CPU work and where it waits (a Slurm time limit, a timeout under test)."""
    out = os.environ.get("DAPO_TEST_CPU_LOG")
    if not out:
        yield
        return

    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    wall, used = time.monotonic(), cpu()
    yield
    with open(out, "a") as f:
        row = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 2), "cpu_s": round(cpu() - used, 2)}
        f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="module", autouse=True)
def _process_group_ends_with_its_module():
    """A module that starts torch.distributed in this process (tests/unit/bridge_helpers.py ``init_single_process``)
    leaves it to the next module on the same xdist worker, which may need a process of its own (the control walk
    starts the fake backend and refuses an initialized one): each module ends with megatron's parallel state and the
    default process group destroyed, if it made them."""
    import sys

    yield
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
