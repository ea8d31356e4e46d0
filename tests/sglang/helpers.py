"""Shared by the real-SGLang tests (tests/sglang on CPU cores, tests/gpu on GPUs): random HF weights of a tiny model,
an HF directory for a server to start from, reference logprobs from transformers, corruption on the way."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_dapo.engines.sglang.client import SGLangEngine
from megatron_dapo.engines.sglang.server import SGLangServer
from megatron_dapo.models.arch import ArchConfig
from megatron_dapo.types import TokenizerInfo
from tests.helpers import REPO

SUPPORT = REPO / "tests" / "sglang_cpu_support"  # the CPU server process's import-only stand-ins
# The demo's tiny Qwen2 (model_configs/tiny.yaml): vocabulary 32 (SGLang pads it to 64), 4 heads, 2 KV heads.
ARCH = ArchConfig(
    name="tiny", family="qwen2", num_layers=2, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4,
    num_query_groups=2, vocab_size=32, max_position_embeddings=512, rope_theta=10000.0, norm_eps=1e-6,
)  # fmt: skip


def random_weights(arch: ArchConfig, seed: int) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors of a random model (no lm_head: tied), scaled like a trained one."""
    from transformers import AutoModelForCausalLM

    from megatron_dapo.models.hf_config import transformers_config

    names = {n: t.shape for n, t in AutoModelForCausalLM.from_config(transformers_config(arch)).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in names.items():
        if name == "lm_head.weight" and arch.tie_embeddings:
            continue
        if name.endswith("norm.weight"):
            out[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("bias") or "embed" in name:
            out[name] = 0.5 * torch.randn(shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g) / shape[-1] ** 0.5
    return out


def save_model(directory: Path, arch: ArchConfig, weights: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    from megatron_dapo.models.hf_config import hf_from_arch

    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(hf_from_arch(arch, "float32")))
    return directory


def cpu_server(model_dir: Path, log_path: Path, *extra: str, **kwargs) -> SGLangServer:
    """A real SGLang server on CPU cores, as demo_cpu_sglang starts it (the project's char tokenizer is no HF
    tokenizer: token ids in, token ids out). mem_fraction 0.25: on CPU SGLang counts the drop of the machine's free
    memory while it loads as its weights' size (srt/mem_cache/kv_cache_configurator.py), so at 0.05 other jobs
    allocating ~1 GiB meanwhile made it refuse to start ("Loaded weights leave no GPU memory for the KV cache"); the
    KV pool itself stays capped by --max-total-tokens."""
    kwargs.setdefault("env", {"OMP_NUM_THREADS": "1"})
    kwargs.setdefault("dtype", "bf16")
    return SGLangServer(
        model_dir, device="cpu", pythonpath=[SUPPORT], mem_fraction=0.25, log_path=log_path,
        extra_args=["--skip-tokenizer-init", "--max-total-tokens", "8192", "--random-seed", "0", *extra], **kwargs,
    )  # fmt: skip


def make_engine(server: SGLangServer, **kwargs) -> SGLangEngine:
    kwargs.setdefault("max_concurrency", 16)
    kwargs.setdefault("dtype", "bf16")  # what the weight sync sends
    return SGLangEngine([server], tokenizer_info=TokenizerInfo((), 0), start=False, **kwargs)


def hf_logprobs(weights: dict[str, torch.Tensor], samples, temperature: float = 1.0, arch: ArchConfig = ARCH,
                device: str = "cpu") -> list[list[float]]:  # fmt: skip
    """log_softmax(logits / temperature) of each sample's response tokens from transformers, in bf16 like the server."""
    from transformers import AutoModelForCausalLM

    from megatron_dapo.models.hf_config import transformers_config

    model = AutoModelForCausalLM.from_config(transformers_config(arch, "bfloat16")).to(device, torch.bfloat16).eval()
    model.load_state_dict({k: v.to(device, torch.bfloat16) for k, v in weights.items()}, strict=False)
    model.tie_weights()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids], device=device)
            logits = model(ids).logits[0, len(s.prompt_ids) - 1 : -1].float() / temperature
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids, device=device)[:, None])
            out.append(lp.squeeze(-1).tolist())
    return out


def mean_gap(samples, reference: list[list[float]]) -> float:
    diffs = [abs(a - b) for s, ref in zip(samples, reference) for a, b in zip(s.logprobs, ref)]
    return sum(diffs) / len(diffs)


def buckets(weights: dict, size: int = 7) -> list[list]:
    items = list(weights.items())
    return [items[i : i + size] for i in range(0, len(items), size)]


def corrupting(sync, name: str):
    """Make ``sync`` send ``name`` with one element changed AFTER the sender recorded it: corruption on the way."""
    send = sync._send

    def bumped(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] += 0.5
        return t

    def tampered_send(stream, version, workers):
        send(([(n, bumped(t) if n == name else t) for n, t in bucket] for bucket in stream), version, workers)

    sync._send = tampered_send
    return sync
