"""Untrusted Python (a model's tool calls) in a subprocess that can neither see nor harm the run.

    result = run_python("print(2**100)", SandboxLimits(wall_s=10))   # SandboxResult(output="1267...\\n", ok=True)

The code runs as ``python -I -S main.py`` in a throwaway directory, under limits on wall-clock time (the whole process
tree is killed), CPU time, address space, file size, open files and processes. Where the kernel allows, it also gets
its own mount, network, PID, IPC and UTS namespaces: its root is an empty tmpfs holding read-only binds of the Python
installation and the system libraries, a writable ``/work`` (its directory) and ``/tmp``; nothing else of the machine
(the run's checkpoints, home directories, the repository) exists there; it has no network interface but a downed
loopback; it sees only its own processes. Started by root, it drops to ``nobody`` before running the code (the
process limit binds only non-root users). Started by another user, an unprivileged user namespace provides the same.

``isolation_problem()`` says why isolation is not available (no user namespaces, a seccomp profile refusing
``unshare``); then ``run_python`` refuses unless ``allow_unisolated`` (only the limits and the directory then).
Every failure (a limit hit, an exception, a killed process) comes back as text in ``SandboxResult.output``.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

NOBODY = 65534
ISOLATION_FAILED = 97  # the bootstrap's exit code when it cannot set up the namespaces


@dataclass
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512  # address space of each process
    file_mb: int = 8  # largest file it may write (its output included)
    processes: int = 16
    open_files: int = 64
    output_chars: int = 2000  # what comes back (the rest is cut, said so)


@dataclass
class SandboxResult:
    output: str
    ok: bool  # exited 0 within its limits
    exit_code: int | None = None
    timed_out: bool = False
    isolated: bool = True


# The bootstrap: runs as the sandbox's first process, sets up isolation and limits, then execs the code. Kept as source
# so that it runs with ``python -I -S -c`` (nothing imported from the package or the working directory).
_BOOTSTRAP = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)

def fail(what):
    err = ctypes.get_errno()
    sys.stdout.write("sandbox isolation failed: %s: %s\n" % (what, os.strerror(err)))
    sys.stdout.flush()
    os._exit(97)

def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        fail("mount %s on %s" % (src, dst))

def bind_ro(path, root):
    target = root + path
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(path, target, None, BIND | REC)
    st = os.statvfs(path)
    locked = st.f_flag & (NOSUID | NODEV | NOEXEC)
    atime = (1024 if st.f_flag & 1024 else 0) | (2048 if st.f_flag & 2048 else 0) | ((1 << 21) if st.f_flag & 4096 else 0)
    mount(None, target, None, REMOUNT | BIND | RDONLY | locked | atime)

def write(path, text):
    with open(path, "w") as f:
        f.write(text)

def limits():
    mb = 1 << 20
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))  # SIGXCPU first: said as such
    for res, value in ((resource.RLIMIT_AS, cfg["memory_mb"] * mb), (resource.RLIMIT_FSIZE, cfg["file_mb"] * mb),
                       (resource.RLIMIT_NOFILE, cfg["open_files"]), (resource.RLIMIT_NPROC, cfg["processes"]),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))

if not cfg["isolate"]:
    limits()
    os.execve(cfg["python"], [cfg["python"], "-I", "-S", "main.py"], cfg["env"])

root_user = os.getuid() == 0
flags = NEWNS | NEWUTS | NEWIPC | NEWPID | NEWNET | (0 if root_user else NEWUSER)
uid, gid = os.getuid(), os.getgid()
if libc.unshare(flags) != 0:
    fail("unshare")
if not root_user:
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", "0 %d 1" % uid)
    write("/proc/self/gid_map", "0 %d 1" % gid)
child = os.fork()  # process 1 of the new PID namespace
if child:
    _, status = os.waitpid(child, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: killing the bootstrap ends the namespace and all in it
mount(None, "/", None, REC | PRIVATE)
root = cfg["root"]
mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "size=1m,mode=755")
for path in cfg["ro_binds"]:
    if os.path.islink(path):
        os.makedirs(os.path.dirname(root + path), exist_ok=True)
        os.symlink(os.readlink(path), root + path)
    elif os.path.exists(path):
        bind_ro(path, root)
for dev in ("null", "zero", "urandom", "random"):
    os.makedirs(root + "/dev", exist_ok=True)
    open(root + "/dev/" + dev, "a").close()
    mount("/dev/" + dev, root + "/dev/" + dev, None, BIND)
os.makedirs(root + "/work")
mount(cfg["work"], root + "/work", None, BIND)
os.makedirs(root + "/tmp")
mount("tmpfs", root + "/tmp", "tmpfs", NOSUID | NODEV, "size=%dm,mode=1777" % cfg["file_mb"])
os.makedirs(root + "/proc")
mount("proc", root + "/proc", "proc", NOSUID | NODEV | NOEXEC)
os.chdir(root)
os.makedirs(".old")
if PIVOT_ROOT is None or libc.syscall(PIVOT_ROOT, b".", b".old") != 0:
    fail("pivot_root")
os.chdir("/")
if libc.umount2(b"/.old", 2) != 0:  # MNT_DETACH
    fail("umount the old root")
os.rmdir("/.old")
mount(None, "/", None, REMOUNT | RDONLY | NOSUID | NODEV)
libc.sethostname(b"sandbox", 7)
if root_user:
    os.setgroups([])
    os.setgid(cfg["drop_to"])
    os.setuid(cfg["drop_to"])
libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
os.chdir("/work")
code = os.fork()  # the code runs as process 2: limits kill it as they would anywhere (init ignores SIGXCPU)
if code == 0:
    limits()
    os.execve(cfg["python"], [cfg["python"], "-I", "-S", "main.py"], cfg["env"])
while True:  # process 1: reap until the code's process ends, then end the namespace with its status
    pid, status = os.wait()
    if pid == code:
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"""


def _system_paths(python: str) -> list[str]:
    """What the interpreter needs to start: its installation and the system libraries (read-only in the sandbox)."""
    prefix = Path(sys.base_prefix).resolve()
    paths = {str(prefix), "/usr", "/bin", "/lib", "/lib64", "/lib32", "/sbin", "/etc/ld.so.cache", "/etc/localtime"}
    paths.add(str(Path(python).resolve().parent))
    return sorted(paths, key=len)


def _python() -> str:
    return str(Path(sys.base_prefix).resolve() / "bin" / Path(sys.executable).resolve().name)


def _start(code: str, limits: SandboxLimits, isolate: bool) -> SandboxResult:
    base = Path(tempfile.mkdtemp(prefix="dapo-sandbox-"))
    try:
        work, root = base / "work", base / "root"
        work.mkdir()
        root.mkdir()
        (work / "main.py").write_text(code)
        if os.getuid() == 0:  # the code runs as nobody: it needs its directory, and the path to it
            for path in (base, work, work / "main.py"):
                os.chown(path, NOBODY, NOBODY)
        python = _python()
        cfg = {
            **asdict(limits),
            "isolate": isolate,
            "python": python,
            "root": str(root),
            "work": str(work),
            "ro_binds": _system_paths(python),
            "drop_to": NOBODY,
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp", "LANG": "C.UTF-8"},
        }
        out_path = base / "output"
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(cfg)],
                cwd=work,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the timeout kills all of it
                env=cfg["env"],
            )
            timed_out = False
            try:
                code_ = proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                code_ = proc.wait()
        with open(out_path, "rb") as f:
            raw = f.read(limits.output_chars * 4 + 1)
        return _result(raw.decode("utf-8", "replace"), code_, timed_out, isolate, limits)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _result(text: str, code: int, timed_out: bool, isolate: bool, limits: SandboxLimits) -> SandboxResult:
    if len(text) > limits.output_chars:
        text = text[: limits.output_chars] + f"\n[output cut at {limits.output_chars} characters]"
    if timed_out:
        text += f"\nerror: timed out after {limits.wall_s:g} s (killed)"
    elif code < 0 or code >= 128:
        sig = -code if code < 0 else code - 128
        why = {signal.SIGXCPU: f"CPU time limit ({limits.cpu_s} s)", signal.SIGXFSZ: "file size limit"}.get(sig, "")
        text += f"\nerror: killed by {signal.Signals(sig).name if sig in signal.valid_signals() else sig}"
        text += f" ({why})" if why else ""
    elif code == ISOLATION_FAILED and isolate:
        text += "\nerror: the sandbox could not isolate the code"
    elif code == 120:  # Python could not flush its output: the file size limit
        text += f"\nerror: output over the file size limit ({limits.file_mb} MiB)"
    elif code != 0:
        text += f"\nerror: exit code {code}"
    return SandboxResult(text, ok=code == 0 and not timed_out, exit_code=code, timed_out=timed_out, isolated=isolate)


@functools.lru_cache(maxsize=1)
def isolation_problem() -> str | None:
    """None when isolated sandboxes work on this machine, else why not (probed once, by running one)."""
    if sys.platform != "linux":
        return f"namespaces need Linux (this is {sys.platform})"
    probe = _start("print('ok')", SandboxLimits(wall_s=30), isolate=True)
    if probe.ok and probe.output.strip() == "ok":
        return None
    return probe.output.strip().splitlines()[0] if probe.output.strip() else f"exit code {probe.exit_code}"


def run_python(code: str, limits: SandboxLimits | None = None, allow_unisolated: bool = False) -> SandboxResult:
    """Run ``code`` in the sandbox (see the module docstring); refuses without isolation unless allowed."""
    limits = limits or SandboxLimits()
    problem = isolation_problem()
    if problem is not None:
        if not allow_unisolated:
            raise SandboxUnavailable(
                f"the Python sandbox cannot isolate code on this machine ({problem}); set "
                "rollout.generate_args.python.allow_unisolated=true to run it with limits only"
            )
        return _start(code, limits, isolate=False)
    return _start(code, limits, isolate=True)


class SandboxUnavailable(RuntimeError):
    """No isolation on this machine and the user has not allowed running without it."""
