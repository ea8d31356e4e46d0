"""The driver's side of a graceful stop (the time-limit signal): pass it to the trainer, then tell the job to resume.

Slurm sends SIGUSR1 before the time limit: to the batch shell (``#SBATCH --signal=B:USR1@T``, our sbatch scripts;
slurm/common.sh writes ``$DAPO_SIGNAL_FILE``), or to the driver's own step (``srun --signal=USR1@T``, nemo-run). The
driver writes the trainer's stop file (``$DAPO_STOP_FILE``: in this allocation's log directory, so a later allocation
never sees it); rank 0 reads it after each step, every rank saves, the trainer exits 0. If the run is then not done,
the driver exits ``EXIT_RESUMABLE`` (75): slurm/common.sh requeues the job, nemo-run's script requeues on any
non-zero exit, and the next allocation continues from the checkpoint (``--resume auto``).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

from megatron_dapo.runs import EXIT_RESUMABLE, SIGNAL_FILE_ENV, latest_checkpoint


def allocation_name(job_id: str | None, env: dict) -> str:
    """``slurm-<job id>``, ``-r<n>`` after the n-th requeue: each allocation of a job keeps its own logs."""
    restart = int(env.get("SLURM_RESTART_COUNT") or 0)
    return f"slurm-{job_id or 'dryrun'}" + (f"-r{restart}" if restart else "")


class StopRelay:
    def __init__(self, stop_file: str | Path, ckpt_dir: str | Path, steps: int, say: Callable[[str], None],
                 signal_file: str | None = None):  # fmt: skip
        self.stop_file, self.ckpt_dir, self.steps, self.say = Path(stop_file), Path(ckpt_dir), steps, say
        self.signal_file = Path(signal_file) if signal_file else None
        self.reason: str | None = None
        self._relayed = False

    @classmethod
    def for_plan(cls, plan, say: Callable[[str], None]) -> StopRelay:
        return cls(plan.stop_file, Path(plan.run_dir) / "checkpoints", plan.steps, say,
                   os.environ.get(SIGNAL_FILE_ENV))  # fmt: skip

    def install(self):
        """Catch SIGUSR1 (its default action would end the driver and the job); returns the previous handler."""
        self.stop_file.unlink(missing_ok=True)  # only a request of this allocation counts

        def on_signal(signum, _frame):
            self.reason = self.reason or signal.Signals(signum).name

        return signal.signal(signal.SIGUSR1, on_signal)

    def poll(self) -> None:
        if self.reason is None and self.signal_file is not None and self.signal_file.exists():
            self.reason = "SIGUSR1 to the batch script"
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
        self.say(f"stopped early: step {done} of {self.steps} is saved in {self.ckpt_dir}; exit code {EXIT_RESUMABLE} "
                 "(resumable): requeue or resubmit the job and it continues from there (--resume auto)")  # fmt: skip
        return EXIT_RESUMABLE
