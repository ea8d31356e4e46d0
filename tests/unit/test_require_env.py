"""``make test`` sets DAPO_REQUIRE_SLURM / DAPO_REQUIRE_MOUNT (as DAPO_REQUIRE_SGLANG): a test that cannot run then
fails instead of skipping (tests/helpers.py ``skip_unless_required``, used by tests/slurm and the full-disk test)."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.helpers import REPO, skip_unless_required


@pytest.mark.parametrize("what", ["slurm", "mount"])
def test_required_means_fail_not_skip(what, monkeypatch):
    var = f"DAPO_REQUIRE_{what.upper()}"
    monkeypatch.delenv(var, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no root here"):
        skip_unless_required(what, "no root here")
    monkeypatch.setenv(var, "1")
    with pytest.raises(pytest.fail.Exception, match=f"{var}=1 but: no root here"):
        skip_unless_required(what, "no root here")


def test_make_test_requires_them():
    recipe = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    for what in ("SGLANG", "SLURM", "MOUNT"):
        assert re.search(rf"DAPO_REQUIRE_{what}=1\b", recipe), recipe
