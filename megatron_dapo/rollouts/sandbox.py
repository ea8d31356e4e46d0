"""Untrusted Python (a model's tool calls) in a sandbox that can neither see nor harm the run, the node or its
neighbours.

    result = run_python("print(2**100)", SandboxLimits(wall_s=10))   # SandboxResult(output="1267...\\n", ok=True)

Each call runs ``python -I -S main.py`` inside its own mount, PID, network, IPC and UTS namespaces
(``sandbox_boot.py`` sets them up: read it for the mechanics). What each call gets, as one unit:

- **memory**: ``memory_mb`` for the whole call: each of its at most ``processes`` processes may map
  ``memory_mb / processes`` (RLIMIT_AS), so their product bounds the call whatever it forks;
- **processes**: at most ``processes`` (threads count) at once for the call alone: started by root, each concurrent
  sandbox runs as a uid of its own (``SLOT_UID_BASE`` + its slot), which RLIMIT_NPROC counts; started by another user,
  each call's user namespace counts its own (Linux 5.14+);
- **disk**: ``/work`` and ``/tmp`` are one tmpfs of ``disk_mb`` and ``disk_files`` inodes in the call's own mount
  namespace: nothing it writes reaches the host's disk, and it vanishes with the call (nothing to clean up);
- **time**: ``wall_s`` (the whole process tree is killed, by the trainer and by the sandbox's own process 1 should the
  trainer be gone), ``cpu_s`` per process; the sample's tool budget (``rollouts/tools.py``) may cut ``wall_s`` shorter;
- **concurrency**: at most ``slots`` sandboxes at once on the node, all trainers of this user together (a lock file
  per slot); a call waits for a free slot, within its deadline;
- **system calls**: a seccomp filter refuses namespaces, mounts, ptrace, keys, bpf, perf, io_uring, kexec and modules;
- **what it sees**: the Python installation and system libraries (read-only), its own ``/work``, ``/tmp``, ``/proc``;
  no network but a downed loopback; no host path in ``/proc/1/cmdline`` or mountinfo (settings and code come on stdin).

No cgroup is needed (Slurm rarely delegates one to a job). ``isolation_problem()`` says why isolation is not available
(no user namespaces, a seccomp profile refusing ``unshare``); then ``run_python`` refuses unless ``allow_unisolated``
(the limits and a host folder only, removed afterwards). Every failure comes back as text in ``SandboxResult.output``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ISOLATION_FAILED = 97  # the bootstrap's exit code when it cannot set up the namespaces
MB = 1 << 20
SLOT_UID_BASE = 1_900_000_000  # started by root: slot i runs as uid and gid SLOT_UID_BASE + i (no account needed)
_BOOT = (Path(__file__).parent / "sandbox_boot.py").read_text()


@dataclass
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5  # CPU seconds of each process
    memory_mb: int = 2048  # the whole call: each process may map memory_mb / processes
    processes: int = 8  # processes and threads of the call at once
    disk_mb: int = 64  # /work and /tmp together (a tmpfs: host memory while the call runs, never the host's disk)
    disk_files: int = 4096  # inodes in it
    file_mb: int = 8  # largest file it may write
    open_files: int = 64
    output_chars: int = 2000  # what comes back (the rest is cut, said so)
    slots: int = 0  # sandboxes at once on this node (this user's trainers together); 0 = the cores this process may use


@dataclass
class SandboxResult:
    output: str
    ok: bool  # exited 0 within its limits
    exit_code: int | None = None
    timed_out: bool = False
    isolated: bool = True


class SandboxUnavailable(RuntimeError):
    """No isolation on this machine and the user has not allowed running without it."""


# ----------------------------------------------------------------------------------------------------------------------
# Slots: how many sandboxes run at once on the node, and (root) which uid each runs as


def slot_count(limits: SandboxLimits) -> int:
    return limits.slots if limits.slots > 0 else len(os.sched_getaffinity(0))


def _slot_dir() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = base / f"dapo-sandbox-slots-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


@contextlib.contextmanager
def sandbox_slot(count: int, deadline: float | None) -> Iterator[int | None]:
    """A free slot of ``count`` on this node (an exclusive ``flock`` on its lock file, released with the call or
    the process), waiting until ``deadline`` (``time.monotonic``); None when the deadline passed first."""
    folder = _slot_dir()
    while True:
        for i in range(count):
            fd = os.open(folder / f"slot-{i}", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield i
            finally:
                os.close(fd)
            return
        if deadline is not None and time.monotonic() >= deadline:
            yield None
            return
        time.sleep(0.02)


# ----------------------------------------------------------------------------------------------------------------------
# One call


def _system_paths(python: str) -> list[str]:
    """What the interpreter needs to start: its installation and the system libraries (read-only in the sandbox)."""
    prefix = Path(sys.base_prefix).resolve()
    paths = {str(prefix), "/usr", "/bin", "/lib", "/lib64", "/lib32", "/sbin", "/etc/ld.so.cache", "/etc/localtime"}
    paths.add(str(Path(python).resolve().parent))
    return sorted(paths, key=len)


def _python() -> str:
    """The base interpreter (not a venv's: its path would name the run's folder in the sandbox's /proc)."""
    return str(Path(sys.base_prefix).resolve() / "bin" / Path(sys.executable).resolve().name)


def _mount_point(binds: list[str]) -> str:
    """An existing folder to mount the sandbox's root on, inside its own mount namespace (the host sees nothing)."""
    for path in (tempfile.gettempdir(), "/mnt", "/srv", "/opt", "/media"):
        if os.path.isdir(path) and not any(b == path or b.startswith(path.rstrip("/") + "/") for b in binds):
            return path
    raise SandboxUnavailable(f"no folder to mount the sandbox's root on (every candidate holds one of {binds})")


def _read_capped(stream, keep: int, out: list[bytes], total: list[int]) -> None:
    """Keeps the first ``keep`` bytes of ``stream`` and drains the rest (the code may print without end), counting."""
    kept = 0
    while chunk := stream.read(65536):
        total[0] += len(chunk)
        if kept < keep:
            out.append(chunk[: keep - kept])
            kept += len(out[-1])


def remove_tree(path: Path) -> None:
    """Removes ``path`` whatever it holds: trees deeper than Python's recursion or PATH_MAX (each level's children are
    moved up one level, so no call goes deeper than two), folders of mode 000, symlinks (removed, never followed),
    files still open."""
    top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        serial = 0
        while names := os.listdir(top):
            for name in names:
                st = os.stat(name, dir_fd=top, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(name, dir_fd=top)
                    continue
                os.chmod(name, 0o700, dir_fd=top)  # a folder, not a symlink (checked): its owner or root may
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
                try:
                    for child in os.listdir(sub):
                        serial += 1
                        os.rename(child, f".up{serial}", src_dir_fd=sub, dst_dir_fd=top)
                finally:
                    os.close(sub)
                os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(path)


def _start(code: str, limits: SandboxLimits, isolate: bool, seccomp: bool, deadline: float | None) -> SandboxResult:
    wall = limits.wall_s if deadline is None else min(limits.wall_s, deadline - time.monotonic())
    if wall <= 0:
        return SandboxResult("error: the sample's tool time is spent (rollout.tools.wall_s_per_sample)", False)
    with sandbox_slot(slot_count(limits), None if deadline is None else deadline) as slot:
        if slot is None:
            return SandboxResult("error: no sandbox slot came free within the sample's tool time", False)
        wall = wall if deadline is None else min(wall, deadline - time.monotonic())
        python, host_dir = _python(), None
        binds = _system_paths(python)
        cfg = {
            **asdict(limits),
            "wall_s": wall,
            "isolate": isolate,
            "seccomp": seccomp,
            "python": python,
            "parent": os.getpid(),
            "ro_binds": binds,
            "drop_to": SLOT_UID_BASE + slot,
            "env": {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": "/work",
                "TMPDIR": "/tmp",
                "LANG": "C.UTF-8",
                "MALLOC_ARENA_MAX": "2",
            },  # fmt: skip - threads' malloc arenas reserve 64 MB of address space each
        }
        if isolate:
            cfg["root"] = _mount_point(binds)
        else:  # a host folder: the limits apply, the folder is removed afterwards whatever the code left in it
            if os.getuid() == 0 and (closed := _closed_to_others(python)):
                raise SandboxUnavailable(f"without isolation the code runs as uid {cfg['drop_to']}, which cannot "
                                         f"run {python} ({closed} is closed to other users): install Python where "
                                         "other users can run it")  # fmt: skip
            host_dir = Path(tempfile.mkdtemp(prefix="dapo-sandbox-"))
            (host_dir / "main.py").write_text(code)
            if os.getuid() == 0:
                for p in (host_dir, host_dir / "main.py"):
                    os.chown(p, cfg["drop_to"], cfg["drop_to"])
            cfg["work"] = str(host_dir)
        try:
            return _run(python, cfg, code, limits, wall, isolate)
        finally:
            if host_dir is not None:
                remove_tree(host_dir)


def _kill_uid(uid: int) -> None:
    """Every process of ``uid`` killed, by a process of that uid (``kill(-1)`` reaches exactly those)."""
    kill = shutil.which("kill") or "/bin/kill"
    subprocess.run([kill, "-KILL", "-1"], user=uid, group=uid, extra_groups=[], cwd="/", env={},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30, check=False)  # fmt: skip


def _closed_to_others(path: str) -> str | None:
    """The first folder on ``path`` (or the file) another user cannot pass or execute, or None."""
    parts = Path(path).parts
    for i in range(1, len(parts) + 1):
        p = Path(*parts[:i])
        if not os.stat(p).st_mode & stat.S_IXOTH:
            return str(p)
    return None


def _run(python: str, cfg: dict, code: str, limits: SandboxLimits, wall: float, isolate: bool) -> SandboxResult:
    proc = subprocess.Popen(
        [python, "-I", "-S", "-c", _BOOT],
        cwd="/",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the timeout kills all of it
        env=cfg["env"],
    )
    chunks: list[bytes] = []
    total = [0]
    keep = limits.output_chars * 4 + 1
    reader = threading.Thread(target=_read_capped, args=(proc.stdout, keep, chunks, total), daemon=True)
    reader.start()
    with contextlib.suppress(BrokenPipeError):  # a bootstrap that failed early reads nothing: its output says why
        proc.stdin.write(json.dumps(cfg).encode() + b"\n" + code.encode("utf-8", "surrogatepass"))
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.close()
    timed_out = False
    try:
        exit_code = proc.wait(timeout=wall)
    except subprocess.TimeoutExpired:  # isolated: the bootstrap kills process 1 and returns when the namespace is gone
        timed_out = True
        exit_code = _stop(proc, isolate)
    if not isolate and os.getuid() == 0:  # what left the process group (setsid) still runs as the slot's uid
        _kill_uid(cfg["drop_to"])
    reader.join(timeout=5)
    if not reader.is_alive():  # (else a survivor holds the pipe: closing it would wait for the reader's lock)
        proc.stdout.close()
    text = b"".join(chunks).decode("utf-8", "replace")
    if exit_code == 0 and total[0] > limits.file_mb * MB:  # as if the output were a file: over its size limit
        exit_code = 120
    return _result(text, exit_code, timed_out, isolate, limits, wall)


def _stop(proc: subprocess.Popen, isolate: bool) -> int:
    if isolate:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


def _result(text: str, code: int, timed_out: bool, isolate: bool, limits: SandboxLimits, wall: float) -> SandboxResult:
    if len(text) > limits.output_chars:
        text = text[: limits.output_chars] + f"\n[output cut at {limits.output_chars} characters]"
    if timed_out or code == 124:
        text += f"\nerror: timed out after {wall:g} s (killed)"
    elif code < 0 or code >= 128:
        sig = -code if code < 0 else code - 128
        why = {signal.SIGXCPU: f"CPU time limit ({limits.cpu_s} s)", signal.SIGXFSZ: "file size limit"}.get(sig, "")
        text += f"\nerror: killed by {signal.Signals(sig).name if sig in signal.valid_signals() else sig}"
        text += f" ({why})" if why else ""
    elif code == ISOLATION_FAILED and isolate:
        text += "\nerror: the sandbox could not isolate the code"
    elif code == 120:  # Python could not flush its output, or printed more than a file may hold
        text += f"\nerror: output over the file size limit ({limits.file_mb} MiB)"
    elif code != 0:
        text += f"\nerror: exit code {code}"
    ok = code == 0 and not timed_out
    return SandboxResult(text, ok=ok, exit_code=code, timed_out=timed_out or code == 124, isolated=isolate)


# ----------------------------------------------------------------------------------------------------------------------
# What this machine allows


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[str | None, bool, str]:
    """(why isolation is unavailable or None, whether the syscall filter works, what the sandbox uses here)."""
    if sys.platform != "linux":
        return f"namespaces need Linux (this is {sys.platform})", False, "none"
    probe = SandboxLimits(wall_s=30, slots=1024)
    for seccomp in (True, False):
        r = _start("print('ok')", probe, isolate=True, seccomp=seccomp, deadline=None)
        if r.ok and r.output.strip() == "ok":
            break
    else:
        first = r.output.strip().splitlines()[0] if r.output.strip() else f"exit code {r.exit_code}"
        return first, False, "limits only"
    who = "a uid per slot (root)" if os.getuid() == 0 else "a user namespace per call"
    path = f"namespaces, tmpfs /work, {who}, " + ("seccomp filter" if seccomp else "no seccomp filter (refused here)")
    return None, seccomp, path


def isolation_problem() -> str | None:
    """None when isolated sandboxes work on this machine, else why not (probed once, by running one)."""
    return _probe()[0]


def isolation_path() -> str:
    """What the sandbox uses on this machine, in words (logged when the Python tool is made)."""
    return _probe()[2]


def run_python(
    code: str, limits: SandboxLimits | None = None, allow_unisolated: bool = False, deadline: float | None = None
) -> SandboxResult:
    """Run ``code`` in the sandbox (see the module docstring), by ``deadline`` (``time.monotonic``) at the latest
    (the sample's tool budget); refuses without isolation unless allowed."""
    limits = limits or SandboxLimits()
    problem = isolation_problem()
    if problem is not None:
        if not allow_unisolated:
            raise SandboxUnavailable(
                f"the Python sandbox cannot isolate code on this machine ({problem}); set "
                "rollout.generate_args.python.allow_unisolated=true to run it with limits only"
            )
        return _start(code, limits, isolate=False, seccomp=False, deadline=deadline)
    return _start(code, limits, isolate=True, seccomp=_probe()[1], deadline=deadline)
