"""Issue 22 #10: in a per-node sync, SGLang TP rank i of an engine gets the serialization made by the trainer rank on
its GPU i, gathered by the poster (slime's ``gather_object``, THUDM/slime update_weight_from_tensor.py L385-399 at
624b824), never one the poster made of its own copy (torch opens a CUDA IPC handle on the producer's device). On CPU
with gloo and SGLang's own serializer, safe unpickler and ``FlattenedTensorBucket`` (shared-memory storages)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from tests.helpers import run_torchrun  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
WORKER = Path(__file__).with_name("gpu_gather_worker.py")


def _records(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]


def test_each_tp_rank_gets_the_serialization_of_the_rank_on_its_gpu(tmp_path):
    run_torchrun(3, WORKER, tmp_path)
    a0, a1, b = _records(tmp_path)
    assert all("error" not in r for r in (a0, a1, b)), (a0, a1, b)
    # TP rank i of engine A <- the serialization made by the rank on GPU i (before the fix: both by rank 0)
    assert [p[1] in a1["made"] for p in a0["posted"]] == [True] * 3, (a0["posted"], a1["made"])
    assert a0["posted"] == [[mine, peer] for mine, peer in zip(a0["made"], a1["made"])]
    assert len(a0["made"]) == len(a1["made"]) == 3 and a1["peer"] and not b["peer"]  # one per bucket per GPU
    assert a1["posted"] == []  # the peer never posts
    assert [len(p) for p in b["posted"]] == [1, 1, 1] and b["posted"] == [[m] for m in b["made"]]  # TP 1: its own
    # what SGLang's TP ranks read (rank 1's shared memory, opened in the poster's process) is the bucket itself
    for r in (a0, b):
        assert r["read"] == [[bucket] * len(bucket_blobs) for bucket, bucket_blobs in zip(r["expected"], r["posted"])]
    assert a0["metrics"]["sync/engines"] == 2 == b["metrics"]["sync/engines"]


def test_a_peer_that_cannot_serialize_fails_every_rank_naming_it(tmp_path):
    run_torchrun(3, WORKER, tmp_path, "peer-fails")
    recs = _records(tmp_path)
    for r in recs:
        assert "rank 1 serializing: RuntimeError: no memory for bucket 1" in r["error"], r
    assert len(recs[0]["posted"]) == 1  # bucket 0 posted; bucket 1 refused on the poster, not posted half
