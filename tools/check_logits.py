#!/usr/bin/env python
"""Compare a Megatron checkpoint's logits with the HF model's on the same prompts (fp32).

    python tools/check_logits.py --hf DIR --megatron DIR --tp 2 --pp 2 [--ep 2] [--prompts FILE] [--tol 1e-4]

The Megatron side runs under ``torchrun`` (gloo on CPU, TP × EP × PP processes: EP for a mixture of experts) through megatron-core's pipeline schedule;
the HF side is ``transformers`` in fp32. Prints max |Δlogit| and top-1 agreement; exits 1 above ``--tol``, 2 on bad
input. Prompts: one per line in FILE, tokenized with the HF directory's tokenizer (or whitespace-separated token ids
when it has none); by default a few fixed sentences, or random token ids for a model without a tokenizer.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Q: 07+45=",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Answer: 42",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_prompts(hf_dir: Path, prompts_file: str | None, vocab_size: int) -> list[list[int]]:
    tokenizer = None
    if any((hf_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    if prompts_file is None:
        if tokenizer is None:
            g = torch.Generator().manual_seed(0)
            return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in (5, 11, 17)]
        lines = DEFAULT_PROMPTS
    else:
        path = Path(prompts_file)
        if not path.is_file():
            raise ValueError(f"--prompts {prompts_file}: file not found")
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        if not lines:
            raise ValueError(f"--prompts {prompts_file}: no prompts")
    out = []
    for i, line in enumerate(lines):
        if tokenizer is not None:
            ids = tokenizer(line, add_special_tokens=False)["input_ids"]
        else:
            try:
                ids = [int(x) for x in line.split()]
            except ValueError:
                raise ValueError(f"--prompts line {i + 1}: no tokenizer in {hf_dir}: give token ids") from None
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad or not ids:
            raise ValueError(f"--prompts line {i + 1}: token ids out of range [0, {vocab_size}) or empty")
        out.append(ids)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Megatron side (one torchrun process per TP × PP rank)


def worker(ckpt: str, tp: int, pp: int, ep: int, prompts_path: str, out_path: str) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_dapo.actor import checkpoint as actor_ckpt
    from megatron_dapo.actor.dist import init_distributed, seed_everything
    from megatron_dapo.actor.provider import build_model, model_position_ids
    from megatron_dapo.bridge.convert import read_meta
    from megatron_dapo.config.run_config import ModelConfig, ParallelConfig

    arch, _ = read_meta(ckpt)
    parallel = ParallelConfig(tp=tp, pp=pp, ep=ep)
    init_distributed(parallel)
    seed_everything(0)
    model_cfg = ModelConfig(dtype="fp32")
    chunks = build_model(arch, model_cfg, parallel, training=False)
    for chunk in chunks:
        chunk.eval()  # inference (megatron-core's MoE layer refuses TP > 1 without sequence parallel in training)
    # Model-only load through the actor's checkpoint code (canonical keys, any TP/PP).
    actor_ckpt.load(SimpleNamespace(model=[SimpleNamespace(module=c) for c in chunks], arch=arch), ckpt, False)
    device = next(chunks[0].parameters()).device
    prompts = torch.load(prompts_path)
    results = []
    for ids in prompts:
        n = len(ids)
        batch = {
            "tokens": torch.tensor([ids], device=device),
            "position_ids": model_position_ids(torch.arange(n, device=device)[None], model_cfg),
            "attention_mask": torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), 1)[None, None],
        }

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            out = model(b["tokens"], b["position_ids"], b["attention_mask"], runtime_gather_output=True)
            return out, lambda logits, non_loss_data=True: logits.detach().float().cpu()

        with torch.no_grad():
            out = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter([batch]),
                model=chunks,
                num_microbatches=1,
                seq_length=n,
                micro_batch_size=1,
                forward_only=True,
                collect_non_loss_data=True,
            )
        if ps.is_pipeline_last_stage():
            results.append(out[0][0, :, : arch.vocab_size].clone())
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------------


def _worker_error(log: str, lines: int = 40) -> str:
    """The first worker traceback in a torchrun log (torchrun's own summary comes last and names no cause)."""
    rows = log.strip().splitlines()
    start = next((i for i, r in enumerate(rows) if "Traceback (most recent call last)" in r), max(0, len(rows) - lines))
    return "\n".join(rows[start : start + lines])


def megatron_logits(
    ckpt: Path, tp: int, pp: int, prompts: list[list[int]], timeout_s: float = 1200, ep: int = 1
) -> list:
    with tempfile.TemporaryDirectory(prefix="check_logits-") as tmp:
        prompts_path, out_path = Path(tmp, "prompts.pt"), Path(tmp, "logits.pt")
        torch.save(prompts, prompts_path)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tp * pp * ep}",
            f"--master-port={_free_port()}", "--master-addr=127.0.0.1", __file__, "--worker",
            "--megatron", str(ckpt), "--tp", str(tp), "--pp", str(pp), "--ep", str(ep),
            "--prompts-pt", str(prompts_path), "--out", str(out_path),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.run(cmd, env=env, timeout=timeout_s, capture_output=True, text=True)
        if proc.returncode != 0 or not out_path.is_file():
            raise RuntimeError(
                f"megatron run failed (exit {proc.returncode}):\n{_worker_error(proc.stdout + proc.stderr)}"
            )
        return torch.load(out_path)


def hf_logits(hf_dir: Path, prompts: list[list[int]]) -> list:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].float() for ids in prompts]


def compare(hf: list, mg: list) -> tuple[float, int, int]:
    max_diff, agree, total = 0.0, 0, 0
    for a, b in zip(hf, mg):
        if a.shape != b.shape:
            raise RuntimeError(f"logit shapes differ: HF {tuple(a.shape)}, Megatron {tuple(b.shape)}")
        max_diff = max(max_diff, (a - b).abs().max().item())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
    return max_diff, agree, total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", help="HF checkpoint directory")
    ap.add_argument("--megatron", required=True, help="megatron-dapo checkpoint directory")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (a mixture of experts)")
    ap.add_argument("--prompts", help="text file, one prompt per line")
    ap.add_argument("--tol", type=float, default=1e-4, help="max allowed |Δlogit|")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-pt", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.megatron, args.tp, args.pp, args.ep, args.prompts_pt, args.out)
        return 0

    from megatron_dapo.bridge.convert import read_meta
    from megatron_dapo.bridge.reshard import check_divisible
    from megatron_dapo.config.typed_yaml import ConfigError
    from megatron_dapo.models.arch import compare_arch
    from megatron_dapo.models.hf_config import arch_from_hf, read_hf_config

    try:
        if not args.hf:
            raise ConfigError("--hf: required")
        hf_dir, ckpt = Path(args.hf), Path(args.megatron)
        arch, _ = read_meta(ckpt)
        compare_arch(
            arch, arch_from_hf(read_hf_config(hf_dir), source=f"{hf_dir}/config.json"), f"{hf_dir}/config.json"
        )
        check_divisible(arch, args.tp, args.pp, ep=args.ep)
        prompts = load_prompts(hf_dir, args.prompts, arch.vocab_size)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mg = megatron_logits(ckpt, args.tp, args.pp, prompts, ep=args.ep)
    ref = hf_logits(hf_dir, prompts)
    max_diff, agree, total = compare(ref, mg)
    ok = max_diff <= args.tol
    print(
        f"tp={args.tp} pp={args.pp} ep={args.ep} prompts={len(prompts)} tokens={total}: max |Δlogit| = {max_diff:.3e} "
        f"(tol {args.tol:g}), top-1 agreement {agree}/{total} ({100.0 * agree / max(total, 1):.1f}%) "
        f"-> {'OK' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
