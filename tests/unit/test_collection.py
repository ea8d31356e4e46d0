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
