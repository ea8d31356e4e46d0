"""Every weight-sync transport against the REAL SGLang 0.5.23 server on CPU cores, through the code that runs on GPU:
tensor (flattened buckets, shared memory here, CUDA IPC handles there), distributed (gloo here, NCCL there), disk.
Each runs inside SGLang's begin/end session where one is required, is verified against /weights_checker (a Qwen2
model: /get_weights_by_name answers 400 for it), and names a tensor corrupted on the way."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from megatron_dapo.config.run_config import load_config
from megatron_dapo.engines.sglang.server import ServerRequestError, http_call
from megatron_dapo.engines.sglang.sync import DiskSync, DistributedSync, TensorSync
from megatron_dapo.loop.rollout import make_weight_sync
from megatron_dapo.types import SamplingParams, WeightSyncError
from tests.sglang.helpers import ARCH, buckets, corrupting, hf_logprobs, mean_gap, random_weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TRANSPORTS = {"disk": DiskSync, "tensor": TensorSync, "distributed": DistributedSync}
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 10, 11, 12]]
SERVER_PARAMS = 16  # embed, norm, 2 x (qkv w+b, o, gate_up, down, 2 norms) in SGLang's fused layout


def transport(kind: str, engine, tmp_path, **kwargs):
    if kind == "disk":
        kwargs["directory"] = tmp_path / "weights"
    if kind == "distributed":
        kwargs["master_address"] = "127.0.0.1"
    return TRANSPORTS[kind](engine, **kwargs)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_sync_is_verified_and_the_server_samples_from_the_new_weights(kind, engine, tmp_path):
    old, new = random_weights(ARCH, seed=10), random_weights(ARCH, seed=11)
    sync = transport(kind, engine, tmp_path)
    try:
        sync.sync(buckets(old), version=1)
        report = sync.sync(buckets(new), version=2)
    finally:
        if hasattr(sync, "close"):
            sync.close()
    assert (report.transport, report.version, report.tensors) == (kind, 2, len(new))
    assert report.verified == SERVER_PARAMS and engine.weight_version == 2
    assert report.bytes == sum(t.numel() * t.element_size() for t in new.values())
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6), n=2)
    assert {s.weight_version for s in out} == {2}
    gap_new, gap_old = mean_gap(out, hf_logprobs(new, out)), mean_gap(out, hf_logprobs(old, out))
    assert gap_new < 0.03 and gap_old > 10 * gap_new, (gap_new, gap_old)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_a_tensor_corrupted_on_the_way_is_caught_and_named(kind, engine, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"
    sync = corrupting(transport(kind, engine, tmp_path), name)
    try:
        with pytest.raises(WeightSyncError, match=rf"v3 via {kind} failed verification: tensor '{name}' on http://"):
            sync.sync(buckets(random_weights(ARCH, seed=12)), version=3)
        assert engine.weight_version != 3
        fused = "model.layers.0.self_attn.k_proj.weight"  # a part of the server's fused qkv_proj
        sync = corrupting(transport(kind, engine, tmp_path), fused)
        with pytest.raises(WeightSyncError, match=rf"'{fused}' .*fused as 'model.layers.0.self_attn.qkv_proj.weight'"):
            sync.sync(buckets(random_weights(ARCH, seed=13)), version=4)
    finally:
        if hasattr(sync, "close"):
            sync.close()


def test_a_tensor_the_sync_left_out_is_caught(engine, tmp_path):
    weights = random_weights(ARCH, seed=14)
    del weights["model.norm.weight"]
    with pytest.raises(WeightSyncError, match="'model.norm.weight' on http://.*held by the receiver but not sent"):
        DiskSync(engine, directory=tmp_path).sync(buckets(weights), version=5)
    sampled = DiskSync(engine, verify="sample", sample_size=3, directory=tmp_path)
    assert sampled.sync(buckets(random_weights(ARCH, seed=14)), version=6).verified == 3


def test_updates_outside_a_session_are_refused_and_never_hang(engine, tmp_path):
    """SGLang 0.5.23 answers 400 to tensor/distributed updates outside begin/end; the distributed sender, whose
    broadcast the server then never joins, must raise instead of blocking forever."""
    with pytest.raises(ServerRequestError, match="between begin_weight_update"):
        http_call(engine.servers[0].url, "/update_weights_from_tensor", {"serialized_named_tensors": ["e30="]})
    sync = DistributedSync(engine, master_address="127.0.0.1")
    sync._session = lambda servers: contextlib.nullcontext()  # what the code did before: no session
    errors = []

    def run():
        try:
            sync.sync(buckets(random_weights(ARCH, seed=15)), version=7)
        except WeightSyncError as e:
            errors.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "the sender blocked in its broadcast"
    assert errors and "between begin_weight_update() and end_weight_update()" in str(errors[0])
    assert engine.health()
    report = DistributedSync(engine, master_address="127.0.0.1").sync(buckets(random_weights(ARCH, 16)), version=8)
    assert report.verified == SERVER_PARAMS  # a new group after the abandoned one


def test_sleep_and_wake_keep_serving(engine):
    engine.sleep(["kv_cache"])
    engine.wake(["kv_cache"])
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].finish_reason == "length"


def test_factory_builds_each_transport_from_config(engine):
    cfg = load_config("demo_cpu", ["rollout.engine=sglang", "rollout.weight_sync=disk", "rollout.sglang.device=cpu",
                                   "rollout.sglang.deterministic=false"])  # fmt: skip
    for kind, cls in TRANSPORTS.items():
        cfg.rollout.weight_sync = kind
        sync = make_weight_sync(cfg, engine)
        assert type(sync) is cls and sync.head_dim == 32 and sync.device == torch.device("cpu")
    assert make_weight_sync(cfg, engine).backend == "gloo"  # distributed: gloo on a CPU (nccl on GPU)
