"""SIGTERM to a process that started SGLang servers stops them (runs.exit_on_terminate, installed by ``dapo train``):
a server runs in its own process group, so without the handler the trainer dies without stopping it; its wrapper then
stops it as an orphan (the backstop for a SIGKILLed trainer)."""

import os
import signal
import subprocess
import sys
import time

from tests.helpers import REPO
from tests.slurm.conftest import process_running as pid_alive


def start_and_terminate(tmp_path, *flags) -> tuple[int, int]:
    """(the worker's exit code after SIGTERM, the stand-in server's pid)."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.unit.terminate_worker", str(tmp_path), *flags], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        server_pid = int(next(tmp_path.glob("server-*.pid")).read_text())
        assert pid_alive(server_pid)
        proc.send_signal(signal.SIGTERM)
        return proc.wait(60), server_pid
    finally:
        proc.kill()


ORPHANED = "is gone: stopping the server"  # the wrapper's backstop (engines/sglang/auth.py), in the server's log


def test_sigterm_stops_the_servers_the_process_started(tmp_path):
    code, server_pid = start_and_terminate(tmp_path)
    assert code == 128 + signal.SIGTERM
    deadline = time.monotonic() + 30
    while pid_alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pid_alive(server_pid), "the server outlived the process that started it"
    assert ORPHANED not in (tmp_path / "server.log").read_text()  # stopped by the trainer, not orphaned


def test_without_the_handler_the_orphaned_server_is_stopped_by_its_wrapper(tmp_path):
    """The fault the handler exists for (so the test above can fail): default SIGTERM skips atexit, the trainer dies
    without stopping its server. The server's wrapper then sees its parent gone and stops it (as after a SIGKILL)."""
    code, server_pid = start_and_terminate(tmp_path, "--no-handler")
    try:
        assert code == -signal.SIGTERM
        deadline = time.monotonic() + 30
        while pid_alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not pid_alive(server_pid), "the orphaned server kept running"
        assert ORPHANED in (tmp_path / "server.log").read_text()
    finally:
        os.killpg(os.getpgid(server_pid), signal.SIGKILL) if pid_alive(server_pid) else None
