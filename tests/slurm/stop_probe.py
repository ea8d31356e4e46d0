"""Stand-in trainer for the stop/requeue tests: waits for its stop file ($DAPO_STOP_FILE), then 'saves' the next step.

Appends to ``<run-dir>/probe.log`` what it saw (its arguments, the allocation, what the stop file said and how long it
waited), and rank 0 writes ``<run-dir>/checkpoints/step_<n>/dapo_meta.json`` for n = the newest step there + 1, as
the trainer does when a stop is requested. Exits 0 (the trainer's graceful stop) or 3 if no stop came within --wait-s.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from megatron_dapo.runs import checkpoint_dir_name, latest_checkpoint


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--wait-s", type=float, default=120)
    args, rest = ap.parse_known_args()
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    stop = Path(os.environ["DAPO_STOP_FILE"])
    t0 = time.monotonic()
    while not stop.exists() and time.monotonic() - t0 < args.wait_s:
        time.sleep(0.05)
    env = os.environ
    record = {"rank": env.get("RANK", "0"), "argv": rest, "restart": env.get("SLURM_RESTART_COUNT", "0"),
              "job": env.get("SLURM_JOB_ID"), "stop": stop.read_text().strip() if stop.exists() else None,
              "waited": round(time.monotonic() - t0, 1)}  # fmt: skip
    with open(run / "probe.log", "a") as f:
        f.write(json.dumps(record) + "\n")
    if record["stop"] is None:
        return 3
    if record["rank"] != "0":
        return 0
    latest = latest_checkpoint(run / "checkpoints")
    step = (latest[0] if latest else 0) + 1
    ckpt = run / "checkpoints" / checkpoint_dir_name(step)
    ckpt.mkdir(parents=True)
    (ckpt / "dapo_meta.json").write_text(json.dumps({"step": step}))
    print(f"stop_probe: saved step {step} ({record})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
