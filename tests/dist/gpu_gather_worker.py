"""torchrun worker of tests/dist/test_gpu_gather.py: ``NodeLocalSync`` with the real ``TensorSync`` on 3 ranks, gloo.
Engine A (TP 2) shares the GPUs of ranks 0 and 1 (rank 0 posts), engine B (TP 1) rank 2's. The servers are stand-ins
that record each POST; the poster reads every serialization it posts as SGLang's TP worker does
(``tp_worker.py`` ``deserialize_own_rank``: ``MultiprocessingSerializer.deserialize``, SGLang's safe unpickler,
after ``monkey_patch_torch_reductions`` on CUDA; then ``FlattenedTensorBucket(...).reconstruct_tensors()``).

    python -m torch.distributed.run --nproc-per-node=3 gpu_gather_worker.py OUT_DIR [peer-fails]
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def sha(blob: str) -> str:
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def sglang_reads(blob: str) -> dict[str, torch.Tensor]:
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    if torch.cuda.is_available():  # on CPU: in this process it would also patch the poster's own serializer
        monkey_patch_torch_reductions()
    data = MultiprocessingSerializer.deserialize(blob)
    fb = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
    return {n: t.clone() for n, t in fb.reconstruct_tensors()}


def export(rank: int, n: int = 3):
    """Every rank's copy of the whole model (export dst=all), bucket by bucket, collective as the real one."""
    for i in range(n):
        t = torch.ones(1)
        dist.all_reduce(t)
        w = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * i
        yield [(f"layer{i}.weight", w), (f"layer{i}.bias", w[0] + 0.5)]


def main(out: str, peer_fails: bool) -> None:
    from megatron_dapo.types import WeightSyncError
    from megatron_dapo.sync.per_node import LocalRoute, NodeLocalSync
    from megatron_dapo.engines.sglang.client import SGLangEngine
    from megatron_dapo.engines.sglang.server import SGLangServer
    from megatron_dapo.engines.sglang.sync import TensorSync

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    engine_of = {0: ("http://engineA", 2), 1: ("http://engineA", 2), 2: ("http://engineB", 1)}
    url, tp = engine_of[rank]
    route = LocalRoute(url, poster=rank in (0, 2), node="n1")
    record: dict = {"rank": rank, "made": [], "posted": [], "read": [], "peer": None}

    from sglang.srt.utils import MultiprocessingSerializer

    serialize = MultiprocessingSerializer.serialize

    def recorded(obj, output_str=False):  # every serialization this rank makes, whoever makes it
        if peer_fails and rank == 1 and len(record["made"]) == 1:
            raise RuntimeError("no memory for bucket 1")
        blob = serialize(obj, output_str=output_str)
        record["made"].append(sha(blob))
        return blob

    MultiprocessingSerializer.serialize = staticmethod(recorded)

    class Recording(TensorSync):
        def _post(self, servers, path, body, timeout=None):
            if path == "/update_weights_from_tensor":
                (req,) = body
                blobs = req["serialized_named_tensors"]
                record["posted"].append([sha(b) for b in blobs])
                record["read"].append([{n: t.tolist() for n, t in sglang_reads(b).items()} for b in blobs])
            return [{"success": True} for _ in servers]

    def make(u):
        server = SGLangServer.attach(u, tp_size=tp, device="cpu")
        return Recording(SGLangEngine([server], dtype="float32", start=False), verify="off")

    try:
        sync = NodeLocalSync(route, make)
        record["peer"] = getattr(sync, "peer", None) is not None
        record["metrics"] = sync.sync(export(rank), version=1)
    except WeightSyncError as e:
        record["error"] = str(e)
    record["expected"] = [{n: t.tolist() for n, t in b} for b in export(rank)]
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["peer-fails"])
