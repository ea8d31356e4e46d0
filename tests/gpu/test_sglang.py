"""Real SGLang (GPU): launch a tiny random model saved as HF safetensors, generate with logprobs, sync weights by
CUDA IPC, NCCL (needs 2 GPUs: NCCL refuses two ranks on one device) and disk, and check the logprob gap against a
transformers forward of the same weights. Skipped cleanly without CUDA or without the sglang package."""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("sglang")

from megatron_dapo.bridge.hf_config import hf_from_arch  # noqa: E402
from megatron_dapo.config import ArchConfig  # noqa: E402
from megatron_dapo.rollout.engine import SamplingParams, TokenizerInfo, logprob_gap  # noqa: E402
from megatron_dapo.rollout.sglang_engine import SGLangEngine, SGLangServer  # noqa: E402
from megatron_dapo.rollout.weight_sync import CudaIpcSync, DiskSync, NcclSync  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

ARCH = ArchConfig(
    name="gpu-tiny", family="llama", num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4,
    num_query_groups=2, vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0, norm_eps=1e-5,
    qkv_bias=False, tie_embeddings=False,
)  # fmt: skip
PROMPTS = [[1, 2, 3, 4], [10, 11], [100, 200, 300, 400, 500, 7]]
GAP_LIMIT = 0.05  # mean |logp_sglang - logp_hf| in bf16 on a random tiny model


def random_weights(seed: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from megatron_dapo.bridge.hf_config import transformers_config

    model = AutoModelForCausalLM.from_config(transformers_config(ARCH))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("norm.weight"):
            out[name] = 1 + 0.1 * torch.randn(t.shape, generator=g)
        elif "embed" in name:
            out[name] = torch.randn(t.shape, generator=g)
        else:
            out[name] = torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5
    return {k: v.to(torch.bfloat16) for k, v in out.items()}


def hf_logprobs(weights: dict, samples) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    from megatron_dapo.bridge.hf_config import transformers_config

    model = AutoModelForCausalLM.from_config(transformers_config(ARCH, "bfloat16")).to("cuda", torch.bfloat16)
    model.load_state_dict({k: v.cuda() for k, v in weights.items()})
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)[len(s.prompt_ids) - 1 : -1]
            out.append(lp.gather(-1, torch.tensor(s.response_ids, device="cuda")[:, None]).squeeze(-1).tolist())
    return out


def gap(weights, samples) -> float:
    ref = hf_logprobs(weights, samples)
    flat_a = [x for s in samples for x in s.logprobs]
    flat_b = [x for r in ref for x in r]
    return logprob_gap(torch.tensor(flat_a), torch.tensor(flat_b))[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("gpu_tiny")
    save_file({k: v.contiguous() for k, v in random_weights(0).items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(hf_from_arch(ARCH, "bfloat16")))
    return d


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    base = ["--skip-tokenizer-init", "--disable-cuda-graph", "--random-seed", "0"]
    server = SGLangServer(
        model_dir, tp_size=1, mem_fraction=0.3, memory_saver=True, dtype="bf16", extra_args=base,
        log_path=tmp_path_factory.mktemp("logs") / "sglang.log",
    )  # fmt: skip
    eng = SGLangEngine([server], tokenizer_info=TokenizerInfo((), 0), dtype="bf16", server_timeout=600)
    yield eng
    eng.shutdown()


def test_generate_with_logprobs_matches_hf(engine):
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16, seed=1), n=2)
    assert len(out) == 6 and all(len(s.response_ids) == len(s.logprobs) == 16 for s in out)
    assert gap(random_weights(0), out) < GAP_LIMIT


def test_cuda_ipc_sync_verified_and_used(engine):
    new = random_weights(1)
    report = CudaIpcSync(engine).sync([list(new.items())[:5], list(new.items())[5:]], version=1)
    assert report.verified == len(new) and engine.weight_version == 1
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16), n=2)
    assert gap(new, out) < GAP_LIMIT
    assert gap(random_weights(0), out) > 5 * GAP_LIMIT, "the old weights must no longer explain the samples"


def test_disk_sync_and_sleep_wake(engine, tmp_path):
    new = random_weights(2)
    engine.sleep()
    engine.wake()
    DiskSync(engine, directory=tmp_path).sync([list(new.items())], version=2)
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8), n=1)
    assert gap(new, out) < GAP_LIMIT


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the server on another GPU than this process")
def test_nccl_sync(model_dir, tmp_path):
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    server = SGLangServer(
        model_dir, tp_size=1, mem_fraction=0.3, dtype="bf16", log_path=tmp_path / "sglang.log",
        extra_args=["--skip-tokenizer-init", "--disable-cuda-graph", "--base-gpu-id", "1"],
    )  # fmt: skip
    with SGLangEngine([server], tokenizer_info=TokenizerInfo((), 0), dtype="bf16") as eng:
        new = random_weights(3)
        report = NcclSync(eng, master_address="127.0.0.1").sync([list(new.items())], version=3)
        assert report.verified == len(new)
        out = eng.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8), n=1)
        assert gap(new, out) < GAP_LIMIT
