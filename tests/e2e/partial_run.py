"""``dapo train`` (demo_cpu) with partial rollout that records, per step, the dataset indices of the prompts it trains,
the carried samples the step must continue (after the stale drop) and the requests sent; with KILL_STEP set it SIGKILLs itself in that step's
rollout, after its first resumed sample came back (mid-step, carried samples in flight), or as the rollout ends when
carried complete groups filled the batch without generating (how many the last cut left complete depends on timing).

    python -m tests.e2e.partial_run RECORD.jsonl KILL_STEP RESUME key=value ...     (KILL_STEP 0 = never)
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
    step_log: dict = {}
    make_group, next_batch, generate, drop = sched._group, sched.next_batch, engine.generate_requests, sched._drop_stale
    collect = sched.collect_groups

    def group(c):
        g = make_group(c)
        g.data_index = c.item.index
        return g

    def requests(reqs, sampling):
        step_log["requests"] += [[list(r.input_ids), r.max_new_tokens] for r in reqs]
        for s in generate(reqs, sampling):
            resumed = tuple(reqs[s.prompt_index].input_ids) in step_log["partial"]
            if step_log["step"] == kill_step and (resumed or not step_log["partial"]):
                os.kill(os.getpid(), signal.SIGKILL)  # a carried sample came back (or the step's first sample)
            yield s

    def drop_stale():  # the carried samples this step must continue: those of the groups not too old
        dropped = drop()
        step_log["partial"] = {tuple(c.item.prompt_ids) + tuple(s.response_ids) for c in sched.carried
                               for s in c.slots if s.response_ids and not s.finished}  # fmt: skip
        return dropped

    def collect_groups(step):
        out = collect(step)
        if step_log["step"] == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)  # nothing was generated: killed before the step trains
        return out

    def batch(step):
        step_log.update(step=step, requests=[], partial=set())
        seqs, extra = next_batch(step)
        record.write(json.dumps({"step": step, "trained": [g.data_index for g in sched.groups],
                                 "carried_in": sorted(map(list, step_log["partial"])), "requests": step_log["requests"],
                                 "prompt_cursor": sched.prompts.state_dict()}) + "\n")  # fmt: skip
        record.flush()
        os.fsync(record.fileno())
        return seqs, extra

    sched._group, sched.next_batch, engine.generate_requests, sched._drop_stale = group, batch, requests, drop_stale
    sched.collect_groups = collect_groups
    trainer.run()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
