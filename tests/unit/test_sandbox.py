"""The Python tool's sandbox against hostile code: each attempt ends as an error message in the tool's output, the
test process (the run) is alive, its files untouched and unread, and no process of the sandbox is left."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from megatron_dapo.rollouts.sandbox import SandboxLimits, SandboxUnavailable, isolation_problem, run_python
from megatron_dapo.rollouts.tools import call_tool, make_tools
from tests.helpers import process_tree

pytestmark = pytest.mark.timeout(300)

LIMITS = SandboxLimits(wall_s=12, cpu_s=2, memory_mb=1024)  # 128 MB for each of 8 processes
SECRET = "ckpt-secret-7f3a"


@pytest.fixture(scope="module")
def isolated():
    problem = isolation_problem()
    if problem and not os.environ.get("DAPO_REQUIRE_SANDBOX"):
        pytest.skip(f"no isolation here: {problem}")
    assert problem is None, problem
    return True


@pytest.fixture
def run_files(tmp_path):
    ckpt = tmp_path / "runs" / "demo" / "checkpoints" / "iter_0000001"
    ckpt.mkdir(parents=True)
    (ckpt / "model.pt").write_text(SECRET)
    return ckpt / "model.pt"


def sandbox_processes() -> list[str]:
    """This test's sandbox processes still alive (not those another test worker runs meanwhile)."""
    mine = process_tree(os.getpid())
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if ("dapo-sandbox" in line or "-I -S main.py" in line) and int(line.split()[0]) in mine]  # fmt: skip


def hostile(run_file) -> dict[str, tuple[str, str]]:
    return {
        "infinite loop": ("while True: pass", "CPU time limit"),
        "sleep forever": ("import time\ntime.sleep(3600)", "timed out after 12 s"),
        "fork bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            "error:",
        ),
        "memory bomb": ("x = bytearray(8 << 30)", "MemoryError"),
        "growing memory": ("x = []\nwhile True:\n    x.append(' ' * 10**7)", "MemoryError"),
        "read the checkpoints": (f"print(open({str(run_file)!r}).read())", "FileNotFoundError"),
        "write outside": ("open('/usr/evil', 'w').write('x')", "Read-only file system"),
        "fill the disk": ("open('/tmp/big', 'wb').write(b'x' * (64 << 20))", "File too large"),
        "open a socket": (
            "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)",
            "Network is unreachable",
        ),
        "signal the run": (f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)", "ProcessLookupError"),
        "signal everyone": ("import os, signal\nos.kill(-1, signal.SIGKILL)", "ProcessLookupError"),
        "flood the output": ("print('x' * 10**7)", "[output cut at 2000 characters]"),
        "outlive it": (
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\nraise SystemExit('left')",
            "left",
        ),
    }


def test_hostile_code_ends_as_an_error_message_and_the_run_goes_on(isolated, run_files):
    for name, (code, needle) in hostile(run_files).items():
        start = time.monotonic()
        result = run_python(code, LIMITS)
        assert not result.ok, f"{name}: {result.output[-300:]}"
        assert needle in result.output, f"{name}: {result.output[-300:]}"
        assert SECRET not in result.output, name
        assert time.monotonic() - start < LIMITS.wall_s + 10, name
    assert run_files.read_text() == SECRET  # the run's files: there, unchanged
    time.sleep(0.5)
    assert sandbox_processes() == []  # the fork bomb and the process that outlived its parent: gone


def test_the_home_shows_at_most_the_python_installation(isolated):
    """The interpreter may live in the home (pyenv): its folder is bound read-only, nothing else of the home."""
    home = os.path.realpath(os.path.expanduser("~"))
    r = run_python(
        f"import os\ntry:\n    print(sorted(os.listdir({home!r})))\nexcept OSError as e:\n    print([])", LIMITS
    )
    visible = set(eval(r.output))  # noqa: S307 - a list literal printed by the sandbox
    prefix = os.path.realpath(sys.base_prefix)
    allowed = {os.path.relpath(prefix, home).split(os.sep)[0]} if prefix.startswith(home + os.sep) else set()
    assert visible <= allowed, (visible, allowed)
    assert len(os.listdir(home)) > len(visible)  # the real home holds more


def test_ordinary_code_runs_and_sees_only_its_own_world(isolated):
    r = run_python("import os\nprint(sum(range(10**6)), os.getpid(), os.getcwd(), sorted(os.listdir('/')))", LIMITS)
    assert r.ok and r.isolated, r.output
    total, pid, cwd, root = r.output.split(" ", 3)
    assert total == str(sum(range(10**6))) and pid == "2" and cwd == "/work"  # its own PID namespace
    assert "work" in root and "home" not in root and "srv" not in root


def test_the_python_tool_returns_the_errors_as_its_output(isolated):
    tools = make_tools(["python"], {"wall_s": 6, "cpu_s": 2})
    assert call_tool(tools, "python", {"code": "print(6 * 7)"}) == ("42\n", True)
    out, ok = call_tool(tools, "python", {"code": "while True: pass"})
    assert not ok and "CPU time limit" in out
    out, ok = call_tool(tools, "python", {})
    assert not ok and "needs a 'code' argument" in out


def test_without_isolation_it_refuses_unless_allowed(monkeypatch):
    from megatron_dapo.rollouts import sandbox

    monkeypatch.setattr(sandbox, "isolation_problem", lambda: "unshare: Operation not permitted")
    with pytest.raises(SandboxUnavailable, match=r"rollout.generate_args.python.allow_unisolated=true"):
        run_python("print(1)", LIMITS)
    tools = make_tools(["python"], {"wall_s": 6})
    with pytest.raises(SandboxUnavailable):  # a setting, not the model's mistake: the run stops, saying which
        call_tool(tools, "python", {"code": "print(1)"})
    closed = os.getuid() == 0 and sandbox._closed_to_others(sandbox._python())
    if closed:  # root runs it as a slot's uid, which must be able to run the interpreter: the run stops, saying so
        with pytest.raises(SandboxUnavailable, match=f"[(]{closed} is closed to other users[)]"):
            run_python("print(1)", LIMITS, allow_unisolated=True)
    else:
        r = run_python("print(1)", LIMITS, allow_unisolated=True)
        assert r.ok and not r.isolated and r.output == "1\n"
