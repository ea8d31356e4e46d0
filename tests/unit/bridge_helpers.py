"""Shared helpers of the bridge tests: tiny random HF checkpoints and a single-process megatron world."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from megatron_dapo.models.arch import ArchConfig
from megatron_dapo.models.hf_config import transformers_config

# Random tiny Qwen2: QKV bias, GQA (4 heads / 2 groups), untied; tiny Llama: tied embeddings, GQA, no bias.
QWEN2_TINY = ArchConfig(
    name="qwen2-tiny",
    family="qwen2",
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=300,
    max_position_embeddings=128,
    rope_theta=10000.0,
    norm_eps=1e-6,
    qkv_bias=True,
    tie_embeddings=False,
)
LLAMA_TINY = ArchConfig(
    name="llama-tiny",
    family="llama",
    num_layers=2,
    hidden_size=48,
    ffn_hidden_size=64,
    num_attention_heads=6,
    num_query_groups=2,
    vocab_size=200,
    max_position_embeddings=128,
    rope_theta=100000.0,
    norm_eps=1e-5,
    qkv_bias=False,
    tie_embeddings=True,
)

# Random tiny Qwen3s: per-head q/k RMSNorm, no QKV bias, head_dim != hidden / heads (24 vs 16; 16 vs 8); untied / tied.
QWEN3_TINY = ArchConfig(
    name="qwen3-tiny", family="qwen3", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
    num_query_groups=2, kv_channels=24, vocab_size=300, max_position_embeddings=128, rope_theta=1000000.0,
    norm_eps=1e-6, qkv_bias=False, qk_layernorm=True, tie_embeddings=False,
)  # fmt: skip
QWEN3_TINY_TIED = ArchConfig(
    name="qwen3-tiny-tied", family="qwen3", num_layers=2, hidden_size=48, ffn_hidden_size=64, num_attention_heads=6,
    num_query_groups=2, kv_channels=16, vocab_size=200, max_position_embeddings=128, rope_theta=1000000.0,
    norm_eps=1e-6, qkv_bias=False, qk_layernorm=True, tie_embeddings=True,
)  # fmt: skip


def make_hf_model(arch: ArchConfig, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A randomly initialised ``transformers`` model of the architecture (norm weights randomised too)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(transformers_config(arch), torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # an MoE router: decisive routes, not near-ties
                p.copy_(torch.randn_like(p))
    return model.to(dtype).eval()


def save_hf(arch: ArchConfig, path: Path, seed: int = 0, dtype=torch.float32, max_shard_size="200MB") -> Path:
    model = make_hf_model(arch, seed, dtype)
    model.save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(tp: int = 1, pp: int = 1) -> None:
    """torch.distributed (gloo, world 1) + megatron parallel state + CPU shims, for in-process model tests."""
    from megatron.core import parallel_state

    from megatron_dapo.actor.cpu import apply_cpu_shims

    if not torch.distributed.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    apply_cpu_shims()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp)
