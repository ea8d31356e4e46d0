"""The per-job server key without a server (tests/sglang/test_security.py has the real one): the args file, the
output redaction of the wrapper, the key's source."""

from __future__ import annotations

import os
import select
import signal
import stat
import subprocess
import sys
import time

import pytest
import yaml

from megatron_dapo.engines.sglang import auth as sglang_auth
from megatron_dapo.engines.sglang.auth import Redactor, secrets_of, write_args_file


def test_args_file_is_private_and_read_back(tmp_path):
    path = tmp_path / "sub" / "args.yaml"
    path.parent.mkdir()
    path.write_text("old")
    os.chmod(path, 0o644)  # an existing file of another mode is replaced, not reused
    write_args_file(path, "k3y")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert yaml.safe_load(path.read_text()) == {"api-key": "k3y", "admin-api-key": "k3y"}
    assert secrets_of(["x", "--config", str(path)]) == [b"k3y"] and secrets_of(["x"]) == []


def test_redactor_replaces_secrets_split_across_chunks():
    r = Redactor([b"s3cret-key"])
    stream = [b"x='s3c", b"ret-k", b"ey' s3cret-", b"nope s3", b"cret-key\n"]
    out = b"".join(r.feed(c) for c in stream) + r.flush()
    assert out == b"x='<redacted>' s3cret-nope <redacted>\n"
    assert Redactor([b"abc"]).feed(b"progress 10%\r") == b"progress 10%\r", "output that cannot be a key is not held"


def test_wrapper_redacts_forwards_the_exit_code_and_hides_the_env_key(tmp_path):
    args = write_args_file(tmp_path / "a.yaml", "TOPSECRET")
    child = "import os, sys; print('key=TOPSECRET', os.environ.get('DAPO_SGLANG_API_KEY')); sys.exit(3)"
    env = {**os.environ, "DAPO_SGLANG_API_KEY": "TOPSECRET"}
    cmd = [
        sys.executable,
        "-m",
        "megatron_dapo.engines.sglang.auth",
        sys.executable,
        "-c",
        child,
        "--config",
        str(args),
    ]
    out = subprocess.run(cmd, capture_output=True, env=env, timeout=60)
    assert out.returncode == 3 and out.stdout == b"key=<redacted> None\n"


def test_key_from_the_environment_else_one_per_process(monkeypatch):
    monkeypatch.setenv("DAPO_SGLANG_API_KEY", "from-env")
    assert sglang_auth.api_key() == "from-env"
    monkeypatch.delenv("DAPO_SGLANG_API_KEY")
    first = sglang_auth.api_key()
    assert len(first) >= 32 and sglang_auth.api_key() == first


def _wrapped(tmp_path, child: str) -> subprocess.Popen:
    """The wrapper running ``python -c child``; returns once the child wrote ``tmp_path/ready`` (its handlers set)."""
    cmd = [sys.executable, "-m", "megatron_dapo.engines.sglang.auth", sys.executable, "-c", child, str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=10)
        time.sleep(0.02)
    return proc


@pytest.mark.timeout(120)
def test_wrapper_forwards_signals_to_the_server(tmp_path):
    """SIGUSR1, SIGHUP, SIGINT and SIGTERM to the wrapper (what srun and the launcher send) reach the server, and the
    wrapper exits with the server's code."""
    child = (
        "import os, signal, sys, time; from pathlib import Path\n"
        "def on(sig, _f):\n"
        "    print('got', signal.Signals(sig).name, flush=True)\n"
        "    if sig == signal.SIGTERM: sys.exit(7)\n"
        "for s in (signal.SIGUSR1, signal.SIGHUP, signal.SIGINT, signal.SIGTERM): signal.signal(s, on)\n"
        "Path(sys.argv[1], 'ready').touch()\n"
        "while True: time.sleep(0.05)\n"
    )
    proc = _wrapped(tmp_path, child)
    for sig in (signal.SIGUSR1, signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        proc.send_signal(sig)  # the next only once the server said it got this one (through the wrapper's output)
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready and proc.stdout.readline() == f"got {sig.name}\n".encode(), f"{sig.name} did not reach the server"
    assert proc.wait(timeout=60) == 7, proc.stderr.read()


@pytest.mark.timeout(120)
def test_server_dies_with_its_wrapper(tmp_path):
    """SIGKILL to the wrapper (it cannot forward that): PR_SET_PDEATHSIG sends the server SIGTERM, no orphan stays."""
    child = (
        "import os, sys, time; from pathlib import Path\n"
        "Path(sys.argv[1], 'pid').write_text(str(os.getpid())); Path(sys.argv[1], 'ready').touch()\n"
        "time.sleep(600)\n"
    )
    proc = _wrapped(tmp_path, child)
    pid = int((tmp_path / "pid").read_text())
    _kill_and_expect_gone(proc, pid, "the server outlived its wrapper")


def _kill_and_expect_gone(proc: subprocess.Popen, pid: int, why: str) -> None:
    """SIGKILL ``proc``; the server ``pid`` must be gone within 30 s (SIGKILLed here either way, so none leaks)."""
    try:
        assert _alive(pid)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), why
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.timeout(120)
def test_server_dies_with_the_trainer_that_started_it(tmp_path):
    """SIGKILL to the trainer that started the wrapper (in its own session, as ``SGLangServer`` does): the wrapper sees
    its parent gone and stops the server; nothing is left running (a leaked CPU server holds GBs and both cores)."""
    child = (
        "import os, sys, time; from pathlib import Path\n"
        "Path(sys.argv[1], 'pid').write_text(str(os.getpid())); Path(sys.argv[1], 'ready').touch()\n"
        "time.sleep(600)\n"
    )
    trainer = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'megatron_dapo.engines.sglang.auth', sys.executable, '-c', "
        f"{child!r}, {str(tmp_path)!r}], start_new_session=True, stdout=subprocess.DEVNULL)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", trainer], start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    pid = int((tmp_path / "pid").read_text())
    _kill_and_expect_gone(proc, pid, "the server outlived the trainer that started it")
