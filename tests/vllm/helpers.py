"""Shared by the real-vLLM tests: the server as demo_cpu_vllm starts it, an engine on it, and a tiny model whose
distributions are not one-hot (random weights of the demo's size put ~all mass on one token; logprobs near 0 compare
nothing)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_dapo.engines.vllm.client import VLLMEngine
from megatron_dapo.engines.vllm.server import VLLMServer
from megatron_dapo.types import TokenizerInfo
from tests.helpers import REPO
from tests.sglang.helpers import ARCH, random_weights

VLLM_PYTHON = os.environ.get("DAPO_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


def flat_weights(seed: int) -> dict[str, torch.Tensor]:
    """``random_weights`` with the (tied) embedding scaled down: logits of a few units, samples that vary."""
    w = random_weights(ARCH, seed)
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"] * 0.15
    return w


def cpu_server(model_dir: Path, log_path: Path, *extra: str, **kwargs) -> VLLMServer:
    """A real vLLM server on CPU cores as demo_cpu_vllm starts it (char tokenizer: token ids in, token ids out)."""
    kwargs.setdefault("env", {"OMP_NUM_THREADS": "1"})
    kwargs.setdefault("dtype", "bf16")
    return VLLMServer(
        model_dir, python=VLLM_PYTHON, device="cpu", kv_cache_gib=0.25, log_path=log_path,
        extra_args=["--skip-tokenizer-init", "--max-model-len", "512", "--seed", "0", *extra], **kwargs,
    )  # fmt: skip


def make_engine(server: VLLMServer, **kwargs) -> VLLMEngine:
    kwargs.setdefault("max_concurrency", 16)
    kwargs.setdefault("dtype", "bfloat16")
    return VLLMEngine([server], tokenizer_info=TokenizerInfo((), 0), start=False, **kwargs)
