"""The suite collects every test module in the tree (tests/conftest.py guards it); shown on the planted fault."""

import subprocess
import sys

from tests.helpers import REPO


def collect(*opts: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *opts, "tests"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_multi_process_tests_are_collected():
    out = collect()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "tests/dist/test_actor_dist.py::" in out.stdout and "tests/dist/test_rollout_sync.py::" in out.stdout


def test_a_folder_dropped_by_norecursedirs_fails_the_run():
    # pytest's own default list ("dist", "build", ...) is the fault this guards against
    out = collect("-o", "norecursedirs=.* build dist")
    assert out.returncode == 4, out.stdout[-2000:]
    assert "were not collected" in out.stderr and "tests/dist/test_actor_dist.py" in out.stderr


def test_xdist_keeps_each_shared_fixture_folder_on_one_worker():
    from tests.conftest import worker_scope

    # one SGLang server per session, one local Slurm: every test of the folder is one unit of work
    assert {
        worker_scope(n) for n in ("tests/sglang/test_server.py::test_a", "tests/sglang/test_tp2.py::test_b[x]")
    } == {"tests/sglang"}
    assert worker_scope("tests/slurm/test_local_slurm.py::test_c") == "tests/slurm"
    # elsewhere a file is the unit (its module-scoped fixtures built once), so two files may run side by side
    assert worker_scope("tests/unit/test_plan.py::test_d") == "tests/unit/test_plan.py"
    assert worker_scope("tests/e2e/test_learning.py::test_e") != worker_scope("tests/e2e/test_trainer.py::test_e")
    # long scopes are handed out first, so no long test is left for the end of the run
    from tests.conftest import hand_out_rank

    ranks = [hand_out_rank(f"tests/{f}/test_x.py::t") for f in ("sglang", "slurm", "e2e", "dist", "unit")]
    assert ranks == sorted(ranks) and len(set(ranks)) == 5
