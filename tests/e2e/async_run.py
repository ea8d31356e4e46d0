"""``dapo train`` (demo_cpu, HF engine) with ``rollout.schedule`` one_step_off/async that records, per step, the prompts
it trains (their token ids; add2 prompts are distinct enough to count) and the prompt cursor; with KILL_STEP set it
SIGKILLs itself in that step while the producer makes the next step's batch (the trainer training meanwhile): after the
first sample of it came back, or, when carried complete groups fill that batch without generating (partial rollout; how
many groups the cut left complete depends on the timing of the abort), as its collection ends.

    python -m tests.e2e.async_run RECORD.jsonl KILL_STEP RESUME key=value ...     (KILL_STEP 0 = never)
"""

from __future__ import annotations

import json
import os
import signal
import sys

from megatron_dapo.config.run_config import load_config
from megatron_dapo.loop.trainer import Trainer


def main(out: str, kill_step: int, resume: str, overrides: list[str]) -> None:
    trainer = Trainer(load_config("demo_cpu", overrides), resume=resume)
    sched, engine = trainer.schedule, trainer.rollout.engine
    record = open(out, "a")  # noqa: SIM115 (one line per step, flushed to disk before the step trains)
    next_batch, generate, collect = sched.next_batch, engine.generate_requests, sched.inner.collect_groups
    at = {"step": 0}

    def kill_if_ahead() -> None:
        if at["step"] == kill_step and sched.next_step == kill_step + 1:
            os.kill(os.getpid(), signal.SIGKILL)  # the batch ahead is in progress, the step's batch in training

    def requests(reqs, sampling):
        for s in generate(reqs, sampling):
            kill_if_ahead()
            yield s

    def collect_groups(step):
        out = collect(step)
        kill_if_ahead()  # made without generating: still before the producer hands it over
        return out

    def batch(step):
        at["step"] = step
        seqs, extra = next_batch(step)
        record.write(json.dumps({"step": step, "trained": [g.prompt_ids for g in sched.groups],
                                 "prompt_cursor": sched.prompts.state_dict()}) + "\n")  # fmt: skip
        record.flush()
        os.fsync(record.fileno())
        return seqs, extra

    sched.next_batch, engine.generate_requests, sched.inner.collect_groups = batch, requests, collect_groups
    trainer.run()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
