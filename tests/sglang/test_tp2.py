"""A REAL SGLang server with TP = 2 on CPU cores (two scheduler processes, one core each): every transport serializes
or broadcasts to each TP rank, and verification rebuilds each rank's shard (column/row splits of the fused and plain
projections, the padded vocabulary split in row blocks).

KV heads replicated across ranks (TP > KV heads, QKVParallelLinear on GPU) cannot be seen here: on a CPU SGLang pads
the heads instead (sglang/srt/configs/update_config.py adjust_config_with_unaligned_cpu_tp); the model has 2 KV heads
(tests/unit/test_sglang_layout.py covers the replication rule)."""

from __future__ import annotations

import pytest

from megatron_dapo.types import SamplingParams, WeightSyncError
from tests.sglang.helpers import (
    ARCH,
    buckets,
    corrupting,
    cpu_server,
    hf_logprobs,
    make_engine,
    random_weights,
    save_model,
)
from tests.sglang.test_weight_sync import TRANSPORTS, transport

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tp2_engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp2")
    server = cpu_server(save_model(d / "model", ARCH, random_weights(ARCH, 0)), d / "server.log", tp_size=2,
                        env={"OMP_NUM_THREADS": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|1"})  # fmt: skip
    server.start()
    server.wait_healthy(600)
    engine = make_engine(server)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_every_rank_gets_its_shard_verified(kind, tp2_engine, tmp_path, monkeypatch):
    from sglang.srt.utils import MultiprocessingSerializer

    serialize = MultiprocessingSerializer.serialize
    blobs = []
    monkeypatch.setattr(MultiprocessingSerializer, "serialize", lambda *a, **k: blobs.append(1) or serialize(*a, **k))
    weights = random_weights(ARCH, seed=20)
    sync = transport(kind, tp2_engine, tmp_path, head_dim=ARCH.head_dim)
    try:
        report = sync.sync(buckets(weights), version=1)
    finally:
        if hasattr(sync, "close"):
            sync.close()
    assert report.verified == 2 * 16, "16 parameters on each of 2 TP ranks"
    assert len(blobs) == (2 * len(buckets(weights)) if kind == "tensor" else 0), "one serialization per rank"
    out = tp2_engine.generate([[1, 5, 6], [1, 9]], SamplingParams(temperature=1.0, max_new_tokens=5), n=2)
    ref = hf_logprobs(weights, out)
    assert sum(abs(a - b) for s, r in zip(out, ref) for a, b in zip(s.logprobs, r)) / (len(out) * 5) < 0.03


def test_a_corrupted_shard_is_named_with_its_rank(tp2_engine, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight"  # row-parallel: the bump lands in rank 0's half
    sync = corrupting(transport("tensor", tp2_engine, tmp_path, head_dim=ARCH.head_dim), name)
    with pytest.raises(WeightSyncError, match=rf"tensor '{name}' \[TP rank 0\] on http://") as err:
        sync.sync(buckets(random_weights(ARCH, seed=21)), version=2)
    assert "[TP rank 1]" not in str(err.value)
