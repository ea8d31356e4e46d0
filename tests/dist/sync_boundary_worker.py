"""torchrun worker: the trainer's step boundary (next_batch, train, before_sync, weight sync, weights_updated) on two
gloo ranks, each schedule in turn. Rank 0's engine generates the batch made after step 1 for GEN_S seconds, longer
than the default group's collective timeout (DEFAULT_TIMEOUT, what parallel.collective_timeout_s sets); the sync is a
default-group collective, as the export's gathers and sends are. One JSON record per rank: the modes it finished.

    python -m torch.distributed.run --nproc-per-node=2 sync_boundary_worker.py OUT_DIR MODES DEFAULT_TIMEOUT GEN_S
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from tests.unit.test_async_schedule import VersionEngine
from tests.unit.test_schedule import TickEngine, cfg, schedule

SLOW_STEP = 2  # the batch the producer makes while step 1 trains (one_step_off/async), in before_sync at the boundary


class SlowEngine(TickEngine):
    """The tick engine whose first call for step ``SLOW_STEP``'s batch takes ``gen_s`` seconds."""

    def __init__(self, gen_s: float):
        super().__init__()
        self.gen_s, self.step, self.owner, self.slowed = gen_s, 0, None, False

    def generate_requests(self, requests, sampling):
        step = getattr(self.owner, "next_step", None) or self.step  # async: the step its producer makes a batch for
        if step == SLOW_STEP and not self.slowed:
            self.slowed = True
            time.sleep(self.gen_s)
        yield from super().generate_requests(requests, sampling)

    generate_stream = VersionEngine.generate_stream  # the sync schedule's call, on top of generate_requests


def run_mode(mode: str, gen_s: float) -> None:
    from megatron_dapo.loop.control import on_driver

    kind, carry = mode.split("-")
    c = cfg(f"rollout.schedule={kind}", f"rollout.partial={carry}", "rollout.colocate=false", "train.steps=2")
    engine = SlowEngine(gen_s)
    s = schedule(c, engine)
    engine.owner = s
    for owner in (s, getattr(s, "inner", s)):
        owner.engine = None if dist.get_rank() else engine  # rank 0 alone generates
    s.weights_updated(0)
    for step in (1, 2):
        engine.step = step
        on_driver(partial(s.next_batch, step))  # scatter_batch: over the control plane
        dist.all_reduce(torch.ones(1))  # train: every rank, the default group
        s.before_sync()
        parts = [torch.zeros(4) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, torch.full((4,), float(step)))  # the export: the default group's collectives
        s.weights_updated(step)
    s.close()


def main(out: str, modes: str, default_timeout: float, gen_s: float) -> None:
    from megatron_dapo.loop.control import set_control_timeout

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=default_timeout))  # NCCL's role on a GPU
    rank = dist.get_rank()
    set_control_timeout(default_timeout * 20)  # sized to a rollout, not to the default collective timeout
    record = {"rank": rank, "done": []}
    t0 = time.monotonic()
    try:
        for mode in modes.split(","):
            record["mode"] = mode
            run_mode(mode, gen_s)
            record["done"].append(mode)
        record["ok"] = True
    except Exception as e:
        record.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    record["seconds"] = time.monotonic() - t0
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    sys.stdout.flush()
    os._exit(0)  # a group that timed out cannot be torn down cleanly: leave without its collectives


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
