"""Verified weight sync into the HF engine (copy transport) and the checksum it relies on.

The SGLang transports (tensor, distributed, disk) are tested against the real SGLang server in tests/sglang/
(on CPU cores) and tests/gpu/test_sglang.py (GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_dapo.config.run_config import DapoConfig
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.engines.hf import HFEngine
from megatron_dapo.loop.rollout import make_weight_sync
from megatron_dapo.models.arch import ArchConfig
from megatron_dapo.sync import weight_sync as ws
from megatron_dapo.sync.weight_sync import CopySync, tensor_checksum
from megatron_dapo.types import SamplingParams, TokenizerInfo, WeightSyncError

pytestmark = pytest.mark.timeout(300)

ARCH = ArchConfig(
    name="t", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
    vocab_size=40, max_position_embeddings=128, rope_theta=10000.0,
)  # fmt: skip


def fresh_weights(engine: HFEngine, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: 0.1 * torch.randn(tuple(engine.state_tensor(n).shape), generator=g) for n in engine.weight_names()}


def buckets(weights: dict, size: int = 5) -> list[list]:
    items = list(weights.items())
    return [items[i : i + size] for i in range(0, len(items), size)]


@pytest.fixture
def engine():
    return HFEngine(ARCH, TokenizerInfo((), 0))


def reference_checksum(t: torch.Tensor) -> tuple[float, float]:
    x = t.detach().double().reshape(-1).numpy()
    w = 1 + np.arange(x.size) % ws.PERIOD
    return float(np.sum(x)), float(np.sum(x * w))


def test_checksum_matches_an_independent_computation_across_chunks(monkeypatch):
    t = torch.randn(3, 1000, dtype=torch.float32)
    monkeypatch.setattr(ws, "CHUNK_PERIODS", 1)  # chunks of 1021 elements, the last one ragged
    c = tensor_checksum(t)
    total, weighted = reference_checksum(t)
    assert c.shape == (3, 1000)
    assert c.total == pytest.approx(total, rel=1e-12) and c.weighted == pytest.approx(weighted, rel=1e-12)
    assert c.mismatch(tensor_checksum(t.clone())) is None
    assert "position-weighted" in c.mismatch(tensor_checksum(t.flip(-1)))  # same sum, other order
    assert "shape" in c.mismatch(tensor_checksum(t.reshape(1000, 3)))
    bumped = t.clone()
    bumped[2, 999] += 1e-4
    assert c.mismatch(tensor_checksum(bumped)) is not None
    bf = tensor_checksum(t, dtype=torch.bfloat16)  # computed as the receiver stores it
    assert bf.total == pytest.approx(reference_checksum(t.to(torch.bfloat16))[0], rel=1e-12)


def test_copy_sync_loads_verifies_and_reports(engine):
    weights = fresh_weights(engine, 1)
    sync = CopySync(engine)
    report = sync.sync(buckets(weights), version=5)
    assert engine.weight_version == 5
    assert report.version == 5 and report.transport == "copy"
    assert report.tensors == len(weights) == report.verified
    assert report.bytes == sum(t.numel() * t.element_size() for t in weights.values())
    assert report.seconds > 0 and report.gb_per_s > 0
    for name, t in weights.items():
        assert torch.equal(engine.state_tensor(name), t)


def test_copy_sync_casts_to_engine_dtype_and_still_verifies():
    engine = HFEngine(ARCH, TokenizerInfo((), 0), dtype="bf16")
    weights = fresh_weights(engine, 2)  # float32 sent, bfloat16 stored: checksums are taken in bf16
    assert CopySync(engine).sync(buckets(weights), version=1).verified == len(weights)


class LossyEngine(HFEngine):
    """A receiver that loads something other than what it was sent, for one tensor."""

    def __init__(self, *a, corrupt: str, how: str, **kw):
        super().__init__(*a, **kw)
        self.corrupt, self.how = corrupt, how

    def _load_tensor(self, name, tensor):
        if name == self.corrupt:
            if self.how == "bump":
                tensor = tensor.clone()
                tensor.view(-1)[7] += 1e-3
            else:  # a transposed square matrix: same shape, same sum
                tensor = tensor.t().contiguous()
        super()._load_tensor(name, tensor)


@pytest.mark.parametrize("how", ["bump", "transpose"])
def test_receiver_loading_a_different_tensor_fails_naming_it(how):
    name = "model.layers.1.self_attn.q_proj.weight"  # 32 x 32
    engine = LossyEngine(ARCH, TokenizerInfo((), 0), corrupt=name, how=how)
    with pytest.raises(WeightSyncError, match=rf"v3 via copy failed verification: tensor '{name}'"):
        CopySync(engine).sync(buckets(fresh_weights(engine, 3)), version=3)
    assert CopySync(engine, verify="off").sync(buckets(fresh_weights(engine, 3)), version=3).verified == 0


def test_receiver_tampered_after_the_sync_is_caught_on_reverification(engine):
    sync = CopySync(engine)
    sync.sync(buckets(fresh_weights(engine, 4)), version=1)
    expected = sync.last_expected
    assert set(expected) == set(engine.weight_names())
    sync.verify(expected, version=1)  # the untouched receiver verifies
    with torch.no_grad():
        engine.state_tensor("model.norm.weight")[3] += 1e-3
    with pytest.raises(WeightSyncError, match="tensor 'model.norm.weight' on hf-engine"):
        sync.verify(expected, version=1)


def test_nan_in_sent_weights_is_refused(engine):
    weights = fresh_weights(engine, 5)
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    with pytest.raises(WeightSyncError, match="down_proj.weight.*NaN"):
        CopySync(engine).sync(buckets(weights), version=1)


def test_sample_mode_checks_a_per_version_subset(engine, monkeypatch):
    weights = fresh_weights(engine, 6)
    sync = CopySync(engine, verify="sample", sample_size=4)
    seen = []
    observe = sync._observe
    monkeypatch.setattr(sync, "_observe", lambda names, workers: seen.append(tuple(names)) or observe(names, workers))
    rounds = -(-len(weights) // 4)  # every tensor once in this many consecutive versions
    for version in range(1, rounds + 1):
        assert sync.sync(buckets(weights), version=version).verified == 4
    assert len(set(seen)) == rounds, "the sampled subset does not change with the version"
    assert set().union(*seen) == set(weights), "some tensors are never verified"
    sync.sync(buckets(weights), version=1)
    assert seen[-1] == seen[0], "a version's subset is not reproducible"


def test_sample_mode_catches_a_corrupted_tensor_when_sampled():
    name = "model.layers.0.mlp.up_proj.weight"
    engine = LossyEngine(ARCH, TokenizerInfo((), 0), corrupt=name, how="bump")
    sync = CopySync(engine, verify="sample", sample_size=4)
    caught, missed = [], []
    for version in range(1, 13):
        try:
            sync.sync(buckets(fresh_weights(engine, 9)), version=version)
            missed.append(version)
        except WeightSyncError as e:
            assert f"tensor '{name}'" in str(e)
            caught.append(version)
    assert caught and missed  # a sample: it catches the corruption on the versions whose subset holds the tensor


def test_outputs_follow_the_synced_weights(engine):
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)
    CopySync(engine).sync(buckets(fresh_weights(engine, 7)), version=1)
    before = [s.logprobs for s in engine.generate([[1, 2, 3]], sp, n=2)]
    CopySync(engine).sync(buckets({n: 3 * t for n, t in fresh_weights(engine, 8).items()}), version=2)
    after = engine.generate([[1, 2, 3]], sp, n=2)
    assert [s.logprobs for s in after] != before and {s.weight_version for s in after} == {2}


def test_factory_follows_config(engine, tmp_path):
    cfg = DapoConfig()
    assert isinstance(make_weight_sync(cfg, engine), CopySync)
    cfg.rollout.verify_sync = "off"
    assert make_weight_sync(cfg, engine).verify_mode == "off"
    for kind in ("disk", "tensor", "distributed"):
        cfg.rollout.weight_sync = kind
        with pytest.raises(ConfigError, match=f"rollout.weight_sync = '{kind}': rollout.engine 'hf' takes copy"):
            make_weight_sync(cfg, engine)  # the registry's transports for the engine
        cfg.rollout.engine = "sglang"
        with pytest.raises(WeightSyncError, match="needs an SGLang engine"):
            make_weight_sync(cfg, engine)  # the SGLang transport checks what it is given
        cfg.rollout.engine = "hf"
    cfg.rollout.weight_sync = "copy"
    with pytest.raises(WeightSyncError, match=r"needs an in-process engine \(one with state_tensor\), not object"):
        make_weight_sync(cfg, object())
