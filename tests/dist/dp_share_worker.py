"""torchrun worker (DP = 2): one train step of a fresh (seeded) actor on the whole batch everywhere (``whole``) or on
each DP rank's share of it (``share``: ``driver.scatter_batch``, the others' sequences as stubs). The test compares
the two runs: the same parameters and metrics.

    python -m torch.distributed.run --nproc-per-node=2 dp_share_worker.py OUT MODE
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def batch(Sequence) -> list:
    g = torch.Generator().manual_seed(0)
    seqs = []
    for group in range(8):  # 8 prompts x 4 responses of mixed lengths, prompts shared within a group
        prompt = torch.randint(3, 25, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
        for _ in range(4):
            resp = torch.randint(3, 25, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
            mask = torch.ones(len(resp))
            if group == 5:
                mask[-1] = 0  # a loss mask that is not all ones travels with the stub
            seqs.append(Sequence(torch.cat([prompt, resp]), prompt_len=len(prompt),
                                 advantage=float(torch.randn(1, generator=g)), loss_mask=mask))  # fmt: skip
    return seqs


def main(out: str, mode: str) -> None:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.types import Sequence
    from megatron_dapo.actor.shares import RemoteSequence
    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.loop.control import scatter_batch

    cfg = load_config("demo_cpu", ["parallel.tp=1", "train.batch_prompts=8", "train.mini_batch_prompts=4",
                                   "algo.group_size=4", "train.warmup_steps=0"])  # fmt: skip
    actor = MegatronActor(cfg)  # seeded: the same initial weights in both modes
    assert actor.dp_size == 2
    whole = batch(Sequence)
    start = [p.detach().clone() for p in actor.model[0].parameters()]
    if mode == "whole":  # what the loop did before: every rank holds every sequence
        seqs, extra = whole, {"note": "rank 0's"}
    else:
        seqs, extra = scatter_batch(lambda: (whole, {"note": "rank 0's"}), actor)
    rec = {"rank": dist.get_rank(), "extra": extra, "n": len(seqs),
           "remote": sum(isinstance(s, RemoteSequence) for s in seqs), "pickled": len(pickle.dumps(seqs)),
           "pickled_whole": len(pickle.dumps(whole))}  # fmt: skip
    metrics = actor.train_step(seqs)
    rec["metrics"] = {k: v for k, v in metrics.items() if not k.startswith(("perf/", "time/"))}
    rec["moved"] = max(float((p.detach() - s).abs().max()) for p, s in zip(actor.model[0].parameters(), start))
    torch.save([p.detach().clone() for p in actor.model[0].parameters()], Path(out, f"params{rec['rank']}.pt"))
    Path(out, f"rank{rec['rank']}.json").write_text(json.dumps(rec))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
