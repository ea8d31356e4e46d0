"""torchrun worker: rank 0 alone "generates" for longer than the default group's collective timeout while the other
ranks wait, as in a rollout or eval phase. ``control``: they wait on the control plane (driver.on_driver: a gloo group
with rollout.control_timeout_s) and every rank gets the result; ``default``: they wait inside a collective of the
default group (what the loop did before issue 14), which times out. Also each rank's barrier of the memory phases.

    python -m torch.distributed.run --nproc-per-node=2 control_plane_worker.py OUT_DIR MODE DEFAULT_TIMEOUT ROLLOUT_S
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch.distributed as dist


def main(out: str, mode: str, default_timeout: float, rollout_s: float) -> None:
    from megatron_dapo.loop.control import on_driver, set_control_timeout
    from megatron_dapo.loop.phases import MemoryPhases

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=default_timeout))  # NCCL's role on a GPU
    rank = dist.get_rank()
    set_control_timeout(default_timeout * 20)  # sized to the phase, not to the default collective timeout

    def rollout():
        time.sleep(rollout_s)
        return [{"group": i, "tokens": list(range(5))} for i in range(3)]

    record = {"rank": rank, "mode": mode}
    t0 = time.monotonic()
    try:
        if mode == "control":
            record["result"] = on_driver(rollout)
            phases = MemoryPhases(None, None, offload=lambda a: None, reload=lambda a: None)
            phases.to_train()  # control_barrier inside
            phases.to_rollout()
            record["phase"] = phases.phase
        else:
            box = [rollout() if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)  # the default group's timeout
            record["result"] = box[0]
        record["ok"] = True
    except Exception as e:  # the expected failure of the default-group mode
        record.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    record["waited_s"] = time.monotonic() - t0
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    if mode == "control":
        dist.destroy_process_group()
    else:
        sys.stdout.flush()
        import os

        os._exit(0)  # a group that timed out cannot be torn down cleanly: leave without its collectives


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
