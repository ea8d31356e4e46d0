"""Routing replay's routes from the REAL SGLang 0.5.23 CPU server: a tiny random Qwen3-MoE (6 experts, top-2, every
layer MoE: SGLang 0.5.23 serves no dense Qwen3-MoE layer, models/qwen3_moe.py) served by sglang/srt/models/qwen3_moe.py with --enable-return-routed-experts (its host buffer allocated by the
CPU stand-in in tests/sglang_cpu_support/sitecustomize.py). Every sample carries [prompt + response - 1, MoE layers,
top-k] routes, and they are the experts transformers' model routes the same tokens to."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.engines.hf import HFEngine, checkpoint_views
from megatron_dapo.engines.sglang.routes import RouteLayout
from megatron_dapo.models.arch import load_arch
from megatron_dapo.types import SamplingParams, TokenizerInfo
from tests.sglang.helpers import buckets, cpu_server, make_engine, save_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ARCH = load_arch("tiny-moe-all")
LAYOUT = RouteLayout(num_layers=4, moe_layers=(0, 1, 2, 3), topk=2)
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 10, 11, 12]]


def _random_moe(seed: int) -> torch.nn.Module:
    """transformers' Qwen3MoeForCausalLM with weights scaled like a trained model's (randn / sqrt(fan-in)), so the
    routers' top-k are rarely near ties."""
    from transformers import AutoModelForCausalLM

    from megatron_dapo.models.hf_config import transformers_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(transformers_config(ARCH, "float32"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn_like(p)
                if name.endswith("norm.weight")
                else torch.randn_like(p) / p.shape[-1] ** 0.5
            )
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = _random_moe(0)
    weights = {n: t.detach().clone() for n, t in checkpoint_views(model.state_dict()).items()}
    assert "model.layers.0.mlp.experts.5.down_proj.weight" in weights  # per-expert names, as SGLang's loader reads
    return save_model(tmp_path_factory.mktemp("sglang_moe"), ARCH, weights)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = cpu_server(
        model_dir, tmp_path_factory.mktemp("sglang_moe_logs") / "server.log", "--enable-return-routed-experts"
    )
    s.start()
    s.wait_healthy(600)
    yield s
    s.stop()


def test_every_sample_carries_the_routes_transformers_takes(server, model_dir):
    engine = make_engine(server, routes=LAYOUT)
    try:
        samples = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0), n=2)
    finally:
        engine.shutdown(stop_servers=False)
    assert len(samples) == 6 and all(s.response_ids for s in samples)
    from transformers import AutoModelForCausalLM

    hf = HFEngine(
        ARCH,
        TokenizerInfo((), 0),
        dtype="bf16",
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        return_routes=True,
    )
    expected = hf.routes_of([s.prompt_ids + s.response_ids for s in samples])
    same = total = 0
    for s, ref in zip(samples, expected):
        n = len(s.prompt_ids) + len(s.response_ids)
        assert s.routes is not None and s.routes.dtype == torch.int16 and tuple(s.routes.shape) == (n - 1, 4, 2)
        assert int(s.routes.min()) >= 0 and int(s.routes.max()) < ARCH.num_experts
        engine_sets = s.routes.sort(-1).values
        same += int((engine_sets == ref.sort(-1).values).all(-1).sum())
        total += engine_sets.shape[0] * engine_sets.shape[1]
    assert same / total >= 0.97, f"the server's routes agree with transformers' on {same} of {total} token x layers"


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in checkpoint_views(_random_moe(seed).state_dict()).items()}


def test_a_sync_of_every_expert_is_verified_and_the_server_routes_with_the_new_router(server):
    """Per-expert HF tensors (the bridge's export) arrive in SGLang's stacked w13/w2 experts and are verified against
    /weights_checker; the routes after the sync are the new model's, not the old one's (bf16 weights: 103 to 108 of
    108 token x layer sets agree with transformers' top-k; CI, 2026-12-06)."""
    from transformers import AutoModelForCausalLM

    from megatron_dapo.engines.sglang.sync import TensorSync
    from megatron_dapo.models.hf_config import transformers_config

    engine = make_engine(server, routes=LAYOUT)
    try:
        new = _weights(7)
        report = TensorSync(engine, head_dim=ARCH.head_dim).sync(buckets(new), version=5)
        # per layer: qkv, o, q/k norms, 2 norms, router, w13, w2; + embed, final norm, lm_head
        assert (report.version, report.tensors, report.verified) == (5, len(new), 4 * 9 + 3)
        samples = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0), n=1)
    finally:
        engine.shutdown(stop_servers=False)

    def agreement(seed: int) -> float:
        """Of the server's token x layer top-k sets, the share transformers' model of ``seed`` routes alike."""
        model = AutoModelForCausalLM.from_config(transformers_config(ARCH, "float32"))
        model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in _random_moe(seed).state_dict().items()})
        hf = HFEngine(ARCH, TokenizerInfo((), 0), dtype="fp32", model=model, return_routes=True)
        ref = hf.routes_of([s.prompt_ids + s.response_ids for s in samples])
        same = sum(int((s.routes.sort(-1).values == r.sort(-1).values).all(-1).sum()) for s, r in zip(samples, ref))
        return same / sum(r.shape[0] * r.shape[1] for r in ref)

    new_model, old_model = agreement(7), agreement(0)  # synced now / the weights the server started with
    assert new_model >= 0.9 and old_model < 0.5, (new_model, old_model)


def test_one_corrupted_expert_is_caught_and_named(server):
    from megatron_dapo.engines.sglang.sync import TensorSync
    from megatron_dapo.types import WeightSyncError
    from tests.sglang.helpers import corrupting

    engine = make_engine(server, routes=LAYOUT)
    try:
        name = "model.layers.2.mlp.experts.4.down_proj.weight"
        sync = corrupting(TensorSync(engine, head_dim=ARCH.head_dim), name)
        with pytest.raises(WeightSyncError, match=r"model.layers.2.mlp.experts.w2_weight"):
            sync.sync(buckets(_weights(8)), version=6)
    finally:
        engine.shutdown(stop_servers=False)
