"""A real local Slurm (tools/local_slurm.sh) for the tests marked ``slurm``: two emulated nodes n1, n2 with 8 fake GPUs.

The session fixture starts it in a fresh state directory on free ports (with accounting, which nemo-run's status
polling needs), and stops it at the end, checking that none of its daemons survives.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO, skip_unless_required

SCRIPT = REPO / "tools" / "local_slurm.sh"
HERE = Path(__file__).resolve().parent
TEST_RECIPE_32B = HERE / "recipes" / "sglang_32b.yaml"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def free_port_base() -> int:
    """A base P with P, P+2, P+10, P+11, P+20 free on 127.0.0.1 (the script's port layout)."""
    for _ in range(200):
        base = random.randrange(20000, 60000)
        try:
            for off in (0, 2, 10, 11, 20):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + off))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range found")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_running(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class LocalSlurm:
    state: Path
    port_base: int
    env: dict[str, str]

    def run(self, *cmd: str, timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
        kw = {"env": self.env, "cwd": REPO, **kw}  # env, cwd: e.g. a submission from another directory
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
        if check and proc.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def daemon_pids(self) -> dict[str, int]:
        run = self.state / "run"
        return {p.stem: int(p.read_text().strip()) for p in run.glob("*.pid")} if run.is_dir() else {}

    def job_state(self, job_id: str) -> tuple[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        state = re.search(r"\bJobState=(\S+)", out)
        code = re.search(r"\bExitCode=(\S+)", out)
        return (state.group(1) if state else "UNKNOWN", code.group(1) if code else "?")

    def submit(self, *args: str, **kw) -> str:
        out = self.run("sbatch", "--parsable", *args, **kw).stdout.strip()
        return out.split(";")[0]

    def wait(self, job_id: str, timeout: float) -> tuple[str, str, float]:
        """Poll until the job is over -> (state, exit code "rc:signal", seconds waited); fail after ``timeout``."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            state, code = self.job_state(job_id)
            if state in TERMINAL:
                return state, code, time.monotonic() - t0
            time.sleep(0.3)
        self.run("scancel", job_id, check=False)
        pytest.fail(f"job {job_id} still {self.job_state(job_id)} after {timeout} s")


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "a local Slurm needs root (tools/local_slurm.sh starts munged as munge and slurmd as root)"
    have = all(shutil.which(c) for c in ("slurmctld", "slurmd", "sbatch", "munged", "slurmdbd", "mariadbd"))
    if not have and not shutil.which("apt-get"):
        return "Slurm is not installed and apt-get is not available to install it"
    return None


@pytest.fixture(scope="session")
def local_slurm():
    reason = _skip_reason()
    if reason:
        skip_unless_required("slurm", reason)
    state = Path(tempfile.mkdtemp(prefix="dapo-slurm-test-"))  # short path: the munge socket must fit in 108 bytes
    base = free_port_base()
    cmd = ["bash", str(SCRIPT), "up", "--state", str(state), "--accounting", "--port-base", str(base)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "PYTHONWARNINGS": "ignore"}
    env.pop("SLURM_JOB_ID", None)
    cluster = LocalSlurm(state, base, env)
    try:
        if proc.returncode != 0:
            pytest.fail(f"local_slurm.sh up failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
        assert f"export SLURM_CONF={state}/slurm.conf" in proc.stdout
        yield cluster
    finally:
        pids = cluster.daemon_pids()
        down = subprocess.run(["bash", str(SCRIPT), "down", "--state", str(state)], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        survivors = {name: pid for name, pid in pids.items() if process_running(pid)}
        leftover_files = sorted(p.name for p in (state / "run").glob("*.pid")) if (state / "run").is_dir() else []
        shutil.rmtree(state, ignore_errors=True)
        assert down.returncode == 0, f"local_slurm.sh down failed:\n{down.stderr}"
        assert not survivors, f"daemons still running after down: {survivors}"
        assert not leftover_files, f"pid files left after down: {leftover_files}"


@pytest.fixture
def python() -> str:
    return sys.executable
