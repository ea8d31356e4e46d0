"""torchrun worker (issue 22 #7): rank 0 starts its rollout server in ``RolloutDriver.__init__`` (here a stand-in that
takes START_S seconds, as a health wait does) while the other ranks go on to the first weight export, whose first
collective is in the default group (NCCL on a GPU; gloo with DEFAULT_TIMEOUT here). ``slow``: the start outlasts that
timeout; ``fail``: the start raises.

    python -m torch.distributed.run --nproc-per-node=2 server_start_worker.py OUT_DIR MODE DEFAULT_TIMEOUT START_S
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist


def main(out: str, mode: str, default_timeout: float, start_s: float) -> None:
    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.loop import rollout as driver

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=default_timeout))  # NCCL's role on a GPU
    rank = dist.get_rank()
    driver.set_control_timeout(default_timeout * 20)  # rollout.control_timeout_s: sized to the server start

    def start_server(*args):  # SGLangEngine.from_config: start the server, wait for /health
        time.sleep(start_s)
        if mode == "fail":
            raise RuntimeError("server exited during start-up; log: server.log")
        return types.SimpleNamespace()  # an engine stand-in (the driver sets its resync)

    driver._make_engine = start_server
    driver.make_weight_sync = lambda cfg, engine: None
    record: dict = {"rank": rank, "mode": mode}
    t0 = time.monotonic()
    try:
        driver.RolloutDriver(load_config("demo_cpu"), None, None, Path(out), actor=None)
        record["started_s"] = time.monotonic() - t0
        dist.all_reduce(torch.ones(1))  # the first export's first collective (TP all-gather) in the default group
        record["ok"] = True
    except Exception as e:
        record.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    record["waited_s"] = time.monotonic() - t0
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    sys.stdout.flush()
    os._exit(0)  # a group that timed out (the failure this guards against) cannot be torn down cleanly


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
