"""``dapo train`` (demo_cpu, HF engine) with ``rollout.schedule=stream`` that records, per step, the prompts it trains
and the prompt cursor; with KILL_AT > 0 it SIGKILLs itself when its lanes have delivered that many samples (in this
process): a moment chosen by the caller, anywhere in a step (training, generating ahead, the sync, a save). Each
decoding forward of the engine sleeps ``DECODE_DELAY_S``: the toy model decodes a window in a blink, slowed down its
lanes are still generating when a sync comes, so syncs and checkpoints catch samples halfway.

    python -m tests.e2e.stream_run RECORD.jsonl KILL_AT RESUME key=value ...     (KILL_AT 0 = never)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from megatron_dapo.config.run_config import load_config
from megatron_dapo.loop.trainer import Trainer

DECODE_DELAY_S = 0.02


def main(out: str, kill_at: int, resume: str, overrides: list[str]) -> None:
    trainer = Trainer(load_config("demo_cpu", overrides), resume=resume)
    sched, engine = trainer.schedule, trainer.rollout.engine
    record = open(out, "a")  # noqa: SIM115 (one line per step, flushed to disk before the step trains)
    next_batch, generate = sched.next_batch, engine.generate_requests
    delivered = [0]
    engine.model.register_forward_pre_hook(lambda *_: time.sleep(DECODE_DELAY_S))

    def requests(reqs, sampling):
        for s in generate(reqs, sampling):
            delivered[0] += 1
            if delivered[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            yield s

    def batch(step):
        seqs, extra = next_batch(step)
        record.write(json.dumps({"step": step, "trained": [g.prompt_ids for g in sched.groups],
                                 "responses": [g.responses for g in sched.groups],
                                 "prompt_cursor": sched.prompts.state_dict()}) + "\n")  # fmt: skip
        record.flush()
        os.fsync(record.fileno())
        return seqs, extra

    sched.next_batch, engine.generate_requests = batch, requests
    trainer.run()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
