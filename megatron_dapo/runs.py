"""A run's state on disk and its stop requests, without torch (the Slurm driver reads them on the batch host).

    runs.checkpoints(ckpt_dir)        # [(step, path)] of the complete checkpoints, by step number (oldest first)
    runs.latest_checkpoint(ckpt_dir)  # (step, path) of the newest complete one, or None
    stop = StopRequest.from_env()     # SIGUSR1 to this process, or the file named by $DAPO_STOP_FILE
    stop.requested()                  # -> the reason ("SIGUSR1", "stop file ...") or None

A checkpoint is the directory ``step_<N>`` holding ``dapo_meta.json`` (written last: see actor/checkpoint.py); its
order is the number N, never the name (``step_1000000`` comes after ``step_999999``).

Graceful stop (the time-limit signal): Slurm sends SIGUSR1 to the batch shell some minutes before the time limit
(``#SBATCH --signal=B:USR1@T``); slurm/common.sh turns it into a file the driver (launch/slurm.py) watches, and the
driver writes the trainer's stop file ($DAPO_STOP_FILE, fresh for each allocation). The trainer's rank 0 checks it
after every step; then every rank saves and the trainer exits 0, and the driver exits ``EXIT_RESUMABLE``.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

META_FILE = "dapo_meta.json"
STOP_FILE_ENV = "DAPO_STOP_FILE"  # the trainer's stop file (launch/stop.py writes it)
SIGNAL_FILE_ENV = "DAPO_SIGNAL_FILE"  # slurm/common.sh touches it when the batch shell gets SIGUSR1
EXIT_RESUMABLE = 75  # sysexits.h EX_TEMPFAIL: stopped early after saving; run again (--resume auto) to continue
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message names it and the one that was kept."""


def checkpoint_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def is_complete(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def checkpoints(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint in ``ckpt_dir``, ordered by step number."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for path in ckpt_dir.iterdir():
        m = _STEP_DIR.fullmatch(path.name)
        if m and is_complete(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(ckpt_dir: str | Path) -> tuple[int, Path] | None:
    done = checkpoints(ckpt_dir)
    return done[-1] if done else None


def dir_bytes(path: str | Path) -> int:
    """Bytes of the regular files under ``path`` (a checkpoint's size on disk, for the free-space check)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def exit_on_terminate() -> None:
    """SIGTERM / SIGHUP exit through Python (``SystemExit(128 + signum)``) instead of killing the process at once, so
    ``finally`` blocks and atexit run: the SGLang servers this process started (each in its own process group, which
    would outlive it) are stopped. torchrun's agent and Slurm's scancel stop ranks with SIGTERM before any SIGKILL."""

    def on_terminate(signum, _frame):
        signal.signal(signum, signal.SIG_DFL)  # a second one kills at once
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_terminate)


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """In a child process: the kernel sends it ``sig`` when its parent dies, even by SIGKILL (Linux
    ``prctl(PR_SET_PDEATHSIG)``; nothing elsewhere); ``parent``: the pid that started it, exit now if it is already gone
    (the parent died before this ran). The one place of this workaround: a forked helper or a server wrapper must not
    outlive the process that owns it."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG = 1 (linux/prctl.h)
    if parent is not None and os.getppid() != parent:
        os._exit(0)


class StopRequest:
    """A graceful stop asked for by SIGUSR1 (to this process) or by the file named by ``$DAPO_STOP_FILE``.

    ``install()`` replaces SIGUSR1's default action (terminate) with a flag: call it before anything slow, so that a
    signal that comes early does not kill the process.
    """

    def __init__(self, stop_file: str | Path | None = None):
        self.stop_file = Path(stop_file) if stop_file else None
        self._signal: str | None = None

    @classmethod
    def from_env(cls, env: dict | None = None) -> StopRequest:
        return cls((os.environ if env is None else env).get(STOP_FILE_ENV) or None)

    def install(self) -> StopRequest:
        def on_signal(signum, _frame):
            self._signal = signal.Signals(signum).name

        signal.signal(signal.SIGUSR1, on_signal)
        return self

    def requested(self) -> str | None:
        if self._signal:
            return self._signal
        if self.stop_file is not None and self.stop_file.exists():
            return f"stop file {self.stop_file}"
        return None
