"""torchrun worker of tests/dist/test_node_sync.py: ``NodeLocalSync`` on 3 ranks, 2 engines (ranks 0 and 2 post,
rank 1 only exports). The export is collective (an all-reduce per bucket, as the TP gather of the real one), and
the transports are recorders (our own ``WeightSync`` interface; the real SGLang side: tests/slurm/test_colocated_sglang.py).

    python -m torch.distributed.run --nproc-per-node=3 node_sync_worker.py OUT_DIR FAIL_RANK (-1: none) [init]

``init``: FAIL_RANK's transport cannot even be set up (a bad URL, say): every rank must raise at construction.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


class Recorder:
    def __init__(self, url: str, fail: bool):
        self.url, self.fail, self.received = url, fail, []

    def sync(self, buckets, version):
        from megatron_dapo.sync.weight_sync import SyncReport

        for i, bucket in enumerate(buckets):
            if self.fail and i == 1:
                raise RuntimeError(f"{self.url} refused bucket {i}")
            self.received += [name for name, _ in bucket]
        return SyncReport(version, len(self.received), 8 * len(self.received), 0.01, 0.0, len(self.received), "rec")


def export(n: int = 4):
    for i in range(n):
        t = torch.ones(2)
        dist.all_reduce(t)  # every rank must take part in every bucket
        yield [(f"w{i}", t)]


def main(out: str, fail_rank: int, at_init: bool = False) -> None:
    from megatron_dapo.types import WeightSyncError
    from megatron_dapo.sync.per_node import LocalRoute, NodeLocalSync

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    route = LocalRoute(f"http://engine{rank // 2}", poster=rank % 2 == 0, node=f"n{rank // 2 + 1}")
    recorders = []

    def make(url):
        if at_init and rank == fail_rank:
            raise ValueError(f"cannot reach {url}")
        recorders.append(Recorder(url, fail=rank == fail_rank))
        return recorders[-1]

    record = {"rank": rank}
    try:
        sync = NodeLocalSync(route, make)
        record["metrics"] = sync.sync(export(), version=3)
        record["routes"] = sync.last_routes
    except WeightSyncError as e:
        record["error"] = str(e)
    record["received"] = recorders[0].received if recorders else None
    t = torch.ones(1)
    dist.all_reduce(t)  # the collectives stayed aligned: this one completes
    record["after"] = float(t)
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["init"])
