"""slurm/common.sh under Slurm's SIGUSR1 at any moment. Bash 5.2 fails a command substitution that is being parsed
when a trapped signal arrives ("trap: line 2: unexpected EOF while looking for matching `)'"; exit 2 under set -e):
CI saw a requeued allocation die so, its signal landing as common.sh logged its first phase. The script logs and
checks with builtins only; this test floods a shell that sources it with SIGUSR1 while it logs phases and runs the
GPU-python check, and asserts it neither fails nor loses a signal's stop file."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.timeout(120)
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CONTAINER_", "PYTHON"))}


def test_sigusr1_storm_while_the_script_logs_and_checks(tmp_path):
    fake = tmp_path / "python"  # a CUDA torch, for dapo_require_gpu_python
    fake.write_text("#!/bin/sh\necho 12.8\n")
    fake.chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(
        f"source {REPO}/slurm/common.sh\n"
        f'echo "$DAPO_SIGNAL_FILE" >{tmp_path}/ready.tmp; mv {tmp_path}/ready.tmp {tmp_path}/ready\n'
        f'i=0; until [[ -e {tmp_path}/stop ]]; do phase "step $((++i))"; ((i % 50)) || dapo_require_gpu_python; done\n'
        "phase done\n"
    )
    env = {**ENV, "DAPO_ROOT": str(REPO), "PYTHON": str(fake), "TMPDIR": str(tmp_path)}
    log = open(tmp_path / "job.err", "w")  # noqa: SIM115 (a pipe would fill: the script blocks, signals pile up)
    job = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.DEVNULL, stderr=log)
    ready = tmp_path / "ready"
    while not ready.exists():  # the traps are set by then
        assert job.poll() is None, job.communicate()
        time.sleep(0.01)
    signal_file = ready.read_text().strip()
    sent = 0
    while job.poll() is None and sent < 1000:
        job.send_signal(signal.SIGUSR1)
        sent += 1
        time.sleep(0.003)
    (tmp_path / "stop").touch()
    job.wait(timeout=100)
    log.close()
    err = (tmp_path / "job.err").read_text()
    assert job.returncode == 0, err[-2000:]
    assert "unexpected EOF" not in err and "== done" in err, err[-2000:]
    handled = err.count("SIGUSR1 (time limit near)")
    assert sent == 1000 and handled > 0, (sent, handled)
    assert not os.path.exists(signal_file)  # the exit trap removes it
