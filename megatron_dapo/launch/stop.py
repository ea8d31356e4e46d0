"""The driver's side of a graceful stop (the time-limit signal): pass it to the trainer, then tell the job to resume.

Slurm sends SIGUSR1 before the time limit to the batch shell (``#SBATCH --signal=B:USR1@T``, our sbatch scripts;
slurm/common.sh writes ``$DAPO_SIGNAL_FILE``). A driver that runs as a job step (nemo-run's) cannot get that signal
alone (``srun --signal`` applies to allocations only, and ``--signal=USR1@T`` without ``B:`` also hits the servers,
whose default action for it is to exit): it watches the job's end time instead (``--stop-before T``). The sbatch
scripts pass ``--stop-before`` too, below their signal margin (``$DAPO_STOP_BEFORE``), as a backstop: Slurm sends the
signal from a periodic check, at most once per allocation, and a requeued allocation was seen to miss it. The driver writes the trainer's stop file (``$DAPO_STOP_FILE``: in this allocation's log directory, so a later allocation
never sees it); rank 0 reads it after each step, every rank saves, the trainer exits 0. If the run is then not done,
the driver exits ``EXIT_RESUMABLE`` (75): slurm/common.sh requeues the job, nemo-run's script requeues on any
non-zero exit, and the next allocation continues from the checkpoint (``--resume auto``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from megatron_dapo.runs import EXIT_RESUMABLE, SIGNAL_FILE_ENV, latest_checkpoint


def requeue(job_id: str | None, say: Callable[[str], None]) -> bool:
    """``scontrol requeue`` this job after a resumable stop, for a driver that runs as a job step (nemo-run's): Slurm
    ends the allocation and queues the job again with the same id and options (slurm/common.sh does this itself)."""
    if not job_id:
        return False
    say(f"requeue job {job_id}: the next allocation resumes from the checkpoint")
    out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if out.returncode:
        say(
            f"scontrol requeue {job_id} failed ({out.stderr.strip()}): resubmit the job, it resumes from the checkpoint"
        )
    return out.returncode == 0


def allocation_name(job_id: str | None, env: dict) -> str:
    """``slurm-<job id>``, ``-r<n>`` after the n-th requeue: each allocation of a job keeps its own logs."""
    restart = int(env.get("SLURM_RESTART_COUNT") or 0)
    return f"slurm-{job_id or 'dryrun'}" + (f"-r{restart}" if restart else "")


def job_end_time(job_id: str | None) -> float | None:
    """The job's end (its time limit), as a Unix time, from ``scontrol``; None without a limit or a job."""
    if not job_id:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bEndTime=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", out.stdout)
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")) if m else None


class StopRelay:
    def __init__(
        self,
        stop_file: str | Path,
        ckpt_dir: str | Path,
        steps: int,
        say: Callable[[str], None],
        signal_file: str | None = None,
        job_id: str | None = None,
        stop_before_s: float = 0,
    ):
        self.stop_file, self.ckpt_dir, self.steps, self.say = Path(stop_file), Path(ckpt_dir), steps, say
        self.signal_file = Path(signal_file) if signal_file else None
        self.job_id, self.stop_before_s = job_id, stop_before_s
        self.reason: str | None = None
        self._relayed = False
        self._end: float | None = None
        self._end_checked = float("-inf")

    @classmethod
    def for_plan(cls, plan, say: Callable[[str], None], stop_before_s: float = 0) -> StopRelay:
        return cls(
            plan.stop_file,
            Path(plan.run_dir) / "checkpoints",
            plan.steps,
            say,
            os.environ.get(SIGNAL_FILE_ENV),
            plan.job_id,
            stop_before_s,
        )

    def _near_time_limit(self) -> str | None:
        if not self.stop_before_s or not self.job_id:
            return None
        now = time.time()
        if now - self._end_checked > 60:  # the limit may be changed while the job runs (scontrol update)
            self._end, self._end_checked = job_end_time(self.job_id), now
        if self._end is not None and self._end - now < self.stop_before_s:
            return f"the time limit is {max(0.0, self._end - now):.0f} s away (--stop-before {self.stop_before_s:.0f})"
        return None

    def install(self):
        """Catch SIGUSR1 (its default action would end the driver and the job); returns the previous handler."""
        self.stop_file.unlink(missing_ok=True)  # only a request of this allocation counts

        def on_signal(signum, _frame):
            self.reason = self.reason or signal.Signals(signum).name

        return signal.signal(signal.SIGUSR1, on_signal)

    def poll(self) -> None:
        if self.reason is None and self.signal_file is not None and self.signal_file.exists():
            self.reason = "SIGUSR1 to the batch script"
        if self.reason is None:
            self.reason = self._near_time_limit()
        if self.reason and not self._relayed:
            self.stop_file.parent.mkdir(parents=True, exist_ok=True)
            self.stop_file.write_text(self.reason + "\n")
            self._relayed = True
            self.say(f"stop requested ({self.reason}): the trainer saves after its current step and stops")

    def exit_code(self) -> int:
        """After the trainer exited 0: EXIT_RESUMABLE if it stopped early on request, else 0."""
        self.poll()
        if not self.reason:
            return 0
        latest = latest_checkpoint(self.ckpt_dir)
        done = latest[0] if latest else 0
        if done >= self.steps:
            return 0
        self.say(
            f"stopped early: step {done} of {self.steps} is saved in {self.ckpt_dir}; exit code {EXIT_RESUMABLE} "
            "(resumable): requeue or resubmit the job and it continues from there (--resume auto)"
        )
        return EXIT_RESUMABLE
