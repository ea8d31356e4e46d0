"""LoRA against full fine-tuning on a CPU: step time and peak memory of MegatronActor.train_step, measured in one run.

    .venv/bin/python bench/bench_lora.py [--arch smollm2-135m] [--rank 16] [--seqs 16] [--len 256] [--steps 5]

Each side runs in its own process (peak memory is the process's ``ru_maxrss``): the same architecture, the same random
sequences (seeded), the same number of DAPO steps; the first step is a warm-up (Adam's states appear there). Printed:
the median step time of each, its ratio, the peak RSS of each and its ratio, and the resident state read from the
live objects (weights, gradient buffers, optimizer states). The memory saved is the base's gradients and Adam states
(``memory.lora_params``); the time saved is the base's weight gradients (about 6N FLOPs a token instead of 8N).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(args) -> dict:
    import resource

    import torch

    warnings.filterwarnings("ignore")
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.planning.rank_step import _resident_parts
    from megatron_dapo.types import Sequence

    torch.set_num_threads(1)
    overrides = [f"model.arch={args.arch}", "train.batch_prompts=1", "train.mini_batch_prompts=1",
                 f"parallel.max_tokens_per_micro_batch={4 * args.len}", f"rollout.sampling.max_new_tokens={args.len}"]  # fmt: skip
    if args.worker == "lora":
        overrides.append(f"model.lora.rank={args.rank}")
    actor = MegatronActor(load_config("demo_cpu", overrides))
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(torch.randint(0, actor.arch.vocab_size, (args.len,), generator=g), prompt_len=args.len // 4,
                     advantage=float(torch.randn(1, generator=g))) for _ in range(args.seqs)]  # fmt: skip
    times = []
    for _ in range(args.steps + 1):
        for s in seqs:
            s.old_logprobs = None
        t = time.perf_counter()
        actor.train_step(seqs)
        times.append(time.perf_counter() - t)
    steady = sorted(times[1:])
    return {
        "step_s": steady[len(steady) // 2],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "resident_mb": {k: v / 2**20 for k, v in _resident_parts(actor).items()},
        "trained_params": sum(p.numel() for m in actor.model for p in m.module.parameters() if p.requires_grad),
        "params": sum(p.numel() for m in actor.model for p in m.module.parameters()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--worker", choices=["full", "lora"])
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = {}
    for side in ("full", "lora"):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", side]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        out[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    full, lora = out["full"], out["lora"]
    print(f"{args.arch}, {args.seqs} sequences x {args.len} tokens a step, LoRA rank {args.rank} on all targets "
          f"({lora['trained_params']:,} of {lora['params']:,} parameters train; full: {full['trained_params']:,})")  # fmt: skip
    for side, r in out.items():
        res = ", ".join(f"{k} {v:.0f}" for k, v in r["resident_mb"].items())
        print(f"  {side:4s}: step {r['step_s']:.2f} s (median of {args.steps}), peak RSS {r['peak_rss_mb']:.0f} MB, "
              f"resident MB: {res}")  # fmt: skip
    print(f"LoRA / full: step time {lora['step_s'] / full['step_s']:.2f}x, peak RSS "
          f"{lora['peak_rss_mb'] / full['peak_rss_mb']:.2f}x, gradients + optimizer "
          f"{(lora['resident_mb']['grads'] + lora['resident_mb']['optimizer']) / (full['resident_mb']['grads'] + full['resident_mb']['optimizer']):.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
