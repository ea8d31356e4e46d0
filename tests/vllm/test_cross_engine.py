"""The three engines agree: the in-process HF engine, the real SGLang server and the real vLLM server, all in bf16 on
the same weights, give the same greedy tokens and logprobs (log_softmax at T = 1 when greedy: engines/base.py),
before and after each one's own weight sync to new weights."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.engines.hf import HFEngine
from megatron_dapo.engines.sglang.sync import TensorSync
from megatron_dapo.engines.vllm.sync import VLLMDiskSync
from megatron_dapo.sync.weight_sync import CopySync
from megatron_dapo.types import SamplingParams, TokenizerInfo
from tests.sglang.helpers import ARCH, buckets
from tests.sglang.helpers import cpu_server as sglang_cpu_server
from tests.sglang.helpers import make_engine as sglang_engine
from tests.vllm.helpers import flat_weights, make_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [(5 * i) % 32 for i in range(40)]]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
TIE = 0.05  # bf16 kernels differ by ~1e-2 in a logit: below this margin between the top two, either token is right


@pytest.fixture(scope="module")
def engines(server, model_dir, tmp_path_factory):
    pytest.importorskip("sglang", reason="the cross-engine test also runs the SGLang server (make test installs it)")
    sg_server = sglang_cpu_server(model_dir, tmp_path_factory.mktemp("cross") / "sglang.log")
    sg_server.start()
    try:
        sg_server.wait_healthy(300)
        hf = HFEngine(ARCH, TokenizerInfo((), 0), dtype=torch.bfloat16)
        engines = {"hf": hf, "sglang": sglang_engine(sg_server), "vllm": make_engine(server)}
        yield engines
        engines["sglang"].shutdown(stop_servers=False)
        engines["vllm"].shutdown(stop_servers=False)
    finally:
        sg_server.stop()


def _sync(name: str, engine, weights: dict, version: int, directory) -> None:
    if name == "hf":
        CopySync(engine).sync(buckets(weights), version)
    elif name == "sglang":
        TensorSync(engine, head_dim=ARCH.head_dim).sync(buckets(weights), version)
    else:
        VLLMDiskSync(engine, head_dim=ARCH.head_dim, directory=directory).sync(buckets(weights), version)


def _agree(results: dict) -> None:
    """Every engine's tokens are the HF engine's up to its first near-tie, and its logprobs there are the HF
    engine's within bf16's difference."""
    ref = results["hf"]
    compared = 0
    for name, samples in results.items():
        for a, b in zip(ref, samples):
            n = 0
            while n < min(len(a.response_ids), len(b.response_ids)) and a.response_ids[n] == b.response_ids[n]:
                n += 1
            if n < len(a.response_ids):
                assert a.meta.get("margins", [1.0] * 99)[n] < TIE, (name, a.response_ids, b.response_ids)
            gaps = [abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])]
            assert max(gaps, default=0.0) < 0.05, (name, gaps)
            compared += n
    assert compared >= 0.8 * len(results) * sum(len(s.response_ids) for s in ref), "the engines barely agree"


def _margins(weights: dict, samples) -> None:
    """The gap between the top two logprobs at each greedy step of the HF reference (where bf16 may flip a tie)."""
    from transformers import AutoModelForCausalLM

    from megatron_dapo.models.hf_config import transformers_config

    model = AutoModelForCausalLM.from_config(transformers_config(ARCH, "bfloat16")).to(torch.bfloat16).eval()
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in weights.items()}, strict=False)
    model.tie_weights()
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0, len(s.prompt_ids) - 1 : -1]
            top = torch.log_softmax(logits.float(), -1).topk(2, dim=-1).values
            s.meta["margins"] = (top[:, 0] - top[:, 1]).tolist()


def test_hf_sglang_and_vllm_agree_before_and_after_a_sync(engines, initial_weights, tmp_path):
    results = {}
    for name, eng in engines.items():
        _sync(name, eng, initial_weights, 0, tmp_path / f"{name}0")  # the HF engine starts from random weights
        results[name] = eng.generate(PROMPTS, GREEDY)
    _margins(initial_weights, results["hf"])
    _agree(results)
    before = [s.response_ids for s in results["vllm"]]
    new = flat_weights(seed=5)
    for name, eng in engines.items():
        _sync(name, eng, new, 1, tmp_path / f"{name}1")
        results[name] = eng.generate(PROMPTS, GREEDY)
    _margins(new, results["hf"])
    _agree(results)
    assert [s.response_ids for s in results["vllm"]] != before, "the sync changed what the engines generate"
    _sync("vllm", engines["vllm"], initial_weights, 0, tmp_path / "back")  # the session's server as it was
