"""Real SGLang on GPUs: the same server, engine, weight-sync transports, begin/end sessions, per-rank serialization
and /weights_checker verification as tests/sglang (CPU cores); here the tensor transport hands over CUDA IPC handles,
the distributed one broadcasts over NCCL (2 GPUs: NCCL refuses two ranks on one device), and the server runs its GPU
kernels with --enable-deterministic-inference. A Qwen2 model (SGLang's /get_weights_by_name answers 400 for it)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if importlib.util.find_spec("sglang") is None:
    if os.environ.get("DAPO_REQUIRE_SGLANG") == "1":  # as tests/sglang: CI never skips these silently
        pytest.fail("DAPO_REQUIRE_SGLANG=1 but sglang is not installed on this GPU machine", pytrace=False)
    pytest.skip("sglang is not installed", allow_module_level=True)

from megatron_dapo.engines.sglang.server import SGLangServer  # noqa: E402
from megatron_dapo.engines.sglang.sync import DiskSync, DistributedSync, TensorSync  # noqa: E402
from megatron_dapo.types import SamplingParams, WeightSyncError  # noqa: E402
from tests.sglang.helpers import (  # noqa: E402
    ARCH,
    buckets,
    corrupting,
    hf_logprobs,
    make_engine,
    mean_gap,
    random_weights,
    save_model,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

GPU_ARCH = dataclasses.replace(ARCH, name="gpu-tiny", hidden_size=256, ffn_hidden_size=512, vocab_size=500)
PROMPTS = [[1, 2, 3, 4], [10, 11], [100, 200, 300, 400, 450, 7]]
GAP_LIMIT = 0.05  # mean |logp_sglang - logp_hf|, both bf16, on a random tiny model
PARAMS = 16  # SGLang's parameters of a 2-layer Qwen2 (fused qkv_proj / gate_up_proj, tied embedding)
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def gpu_server(model_dir, log_path, *extra: str, **kwargs) -> SGLangServer:
    args = ["--skip-tokenizer-init", "--random-seed", "0", "--enable-deterministic-inference", *extra]
    return SGLangServer(model_dir, mem_fraction=0.3, dtype="bf16", log_path=log_path, extra_args=args, **kwargs)


def gap(weights, samples) -> float:
    return mean_gap(samples, hf_logprobs(weights, samples, arch=GPU_ARCH, device="cuda"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("gpu_tiny"), GPU_ARCH, random_weights(GPU_ARCH, 0))


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    server = gpu_server(model_dir, tmp_path_factory.mktemp("logs") / "sglang.log", memory_saver=True)
    server.start()
    server.wait_healthy(600)
    eng = make_engine(server)
    yield eng
    eng.shutdown()


def test_generate_with_logprobs_matches_hf_and_honours_seeds(engine):
    sp = SamplingParams(temperature=1.0, max_new_tokens=16, seed=1)
    out = engine.generate(PROMPTS, sp, n=2)
    assert len(out) == 6 and all(len(s.response_ids) == len(s.logprobs) == 16 for s in out)
    assert gap(random_weights(GPU_ARCH, 0), out) < GAP_LIMIT
    again = engine.generate(PROMPTS, sp, n=2)  # sampling_seed: honoured with --enable-deterministic-inference
    assert [s.response_ids for s in again] == [s.response_ids for s in out]


def test_tensor_sync_cuda_ipc_verified_and_used(engine):
    new = random_weights(GPU_ARCH, 1)
    report = TensorSync(engine).sync(buckets(new), version=1)
    assert report.verified == PARAMS and engine.weight_version == 1
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16), n=2)
    assert gap(new, out) < GAP_LIMIT
    assert gap(random_weights(GPU_ARCH, 0), out) > 5 * GAP_LIMIT, "the old weights must no longer explain the samples"


@pytest.mark.parametrize("transport", [TensorSync, DiskSync])
def test_a_tensor_corrupted_on_the_way_is_named(engine, transport, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"
    sync = corrupting(transport(engine) if transport is TensorSync else transport(engine, directory=tmp_path), name)
    with pytest.raises(WeightSyncError, match=rf"tensor '{name}' on http://"):
        sync.sync(buckets(random_weights(GPU_ARCH, 2)), version=2)


def free_gib() -> float:
    """Free memory on GPU 0, every process counted (the server's allocations are not this process's)."""
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(0)[0] / 2**30


def test_disk_sync_and_sleep_wake_free_and_take_back_gpu_memory(engine, tmp_path):
    """The memory saver really frees the server's memory (mem_fraction 0.3: weights + KV cache + graphs), the weights
    come back alone before the sync (issue 22 #9) and the KV cache with the next generation."""
    total = torch.cuda.mem_get_info(0)[1] / 2**30
    new = random_weights(GPU_ARCH, 3)
    held = free_gib()
    engine.sleep()
    released = free_gib()
    assert released - held > 0.15 * total, f"release freed {released - held:.2f} GiB of {total:.0f}"
    engine.wake(["weights"])
    assert free_gib() > released - 1.0 and free_gib() - held > 0.15 * total  # the KV cache is still released
    assert DiskSync(engine, directory=tmp_path).sync(buckets(new), version=3).verified == PARAMS
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8), n=1)  # resumes the KV cache
    assert engine.released() == [] and abs(free_gib() - held) < 0.05 * total, (held, free_gib())
    assert gap(new, out) < GAP_LIMIT


@two_gpus
def test_distributed_sync_over_nccl(model_dir, tmp_path):
    server = gpu_server(model_dir, tmp_path / "sglang.log", "--base-gpu-id", "1")
    with make_engine(server, server_timeout=600) as eng:
        eng.start()
        new = random_weights(GPU_ARCH, 4)
        sync = DistributedSync(eng, master_address="127.0.0.1")
        assert sync.backend == "nccl"
        assert sync.sync(buckets(new), version=4).verified == PARAMS
        out = eng.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8), n=1)
        assert gap(new, out) < GAP_LIMIT
        with pytest.raises(WeightSyncError, match="tensor 'model.norm.weight' on http://"):
            corrupting(sync, "model.norm.weight").sync(buckets(random_weights(GPU_ARCH, 5)), version=5)
        sync.close()


@two_gpus
def test_tp2_server_gets_one_ipc_serialization_per_rank(model_dir, tmp_path, monkeypatch):
    from sglang.srt.utils import MultiprocessingSerializer

    serialize, blobs = MultiprocessingSerializer.serialize, []
    monkeypatch.setattr(MultiprocessingSerializer, "serialize", lambda *a, **k: blobs.append(1) or serialize(*a, **k))
    server = gpu_server(model_dir, tmp_path / "sglang.log", tp_size=2)
    with make_engine(server, server_timeout=600) as eng:
        eng.start()
        new = random_weights(GPU_ARCH, 6)
        report = TensorSync(eng, head_dim=GPU_ARCH.head_dim).sync(buckets(new), version=6)
        assert report.verified == 2 * PARAMS and len(blobs) == 2 * len(buckets(new))
        out = eng.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8), n=1)
        assert gap(new, out) < GAP_LIMIT
