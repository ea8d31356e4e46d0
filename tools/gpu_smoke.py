#!/usr/bin/env python
"""GPU smoke test on one GPU, in minutes, with only PyTorch (CUDA) and megatron-core installed (no TE, no SGLang).

    python tools/gpu_smoke.py [--out DIR] [--seconds 420]      # make gpu-smoke
    python tools/gpu_smoke.py --cpu-check                     # what a CPU can check: arguments, model builds

Checks, each a row of the table it prints (and writes to --out/gpu_smoke.{md,json}):
1. megatron-core runs on CUDA with none of the CPU shims of ``actor/cpu.py`` applied;
2. the bridge: Megatron logits equal HF transformers' on a small random Qwen2 built here (fp32, loaded through
   ``bridge.load_hf_into_model``), max |Δlogit|;
3. a DAPO ``train_step`` (bf16) on a Qwen2.5-0.5B-shaped model with random weights: tokens/s and model FLOPs
   utilisation (6·N·tokens / time / peak; attention FLOPs not counted), on the layer spec the machine gives (TE if
   installed, else megatron-core's local spec with shared-prompt rows);
4. its peak memory (torch.cuda.max_memory_allocated) against the actor's memory model (``memory.actor_memory``);
5. a CUDA-IPC hand-off: a flattened weight bucket shared with a second process, serialized once per consumer as the
   SGLang tensor transport does (with SGLang's own serializer when sglang is importable, else torch's
   ForkingPickler, which SGLang's wraps), rebuilt there and checksummed against the sender's checksum.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runs from a checkout, without installing the package

SMALL_QWEN2 = dict(name="smoke-qwen2", family="qwen2", num_layers=4, hidden_size=256, ffn_hidden_size=704,
                   num_attention_heads=8, num_query_groups=2, vocab_size=1000, max_position_embeddings=2048,
                   rope_theta=1_000_000.0, qkv_bias=True, tie_embeddings=False)  # fmt: skip
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0}  # dense bf16


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_smoke_out", help="directory for gpu_smoke.md / gpu_smoke.json")
    ap.add_argument("--arch", default="qwen2.5-0.5b", help="architecture of the train-step check")
    ap.add_argument("--groups", type=int, default=16, help="prompts per train step (each with --group responses)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=768, help="longest response; lengths spread over half..max")
    ap.add_argument("--steps", type=int, default=3, help="timed train steps (after one warm-up)")
    ap.add_argument("--cpu-check", action="store_true", help="no GPU: check arguments and model builds only")
    args = ap.parse_args(argv)
    for key in ("groups", "group", "prompt_len", "response_len", "steps"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} = {getattr(args, key)}: must be >= 1")
    return args


def train_config(args, arch_name: str):
    from megatron_dapo.config import load_config

    seqs = args.groups * args.group
    return load_config("demo_cpu", [
        f"model.arch={arch_name}", "model.dtype=bf16", "model.tokenizer=char", "algo.dynamic_sampling=false",
        f"algo.group_size={args.group}", f"train.batch_prompts={args.groups}", f"train.mini_batch_prompts={args.groups}",
        f"algo.gen_batch_prompts={args.groups}", f"data.max_prompt_len={args.prompt_len}",
        f"rollout.sampling.max_new_tokens={args.response_len}", "train.lr=1e-6", "train.min_lr=null",
        f"train.steps={args.steps + 1}",
        f"parallel.max_auto_micro_batch_tokens={max(8192, 2 * (args.prompt_len + seqs * args.response_len // 8))}",
    ])  # fmt: skip


def make_sequences(args, vocab: int, seed: int = 0):
    import torch

    from megatron_dapo.actor.actor import Sequence

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(args.groups):
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=g)
        for _ in range(args.group):
            r = int(torch.randint(args.response_len // 2, args.response_len + 1, (1,), generator=g))
            resp = torch.randint(0, vocab, (r,), generator=g)
            out.append(Sequence(torch.cat([prompt, resp]), args.prompt_len, advantage=float(torch.randn(1, generator=g)),
                                rollout_logprobs=-torch.rand(r)))  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------------------------
# the checks


def check_no_shims() -> dict:
    import megatron.core
    import torch

    from megatron_dapo.actor import cpu

    applied = cpu.shims_applied()
    return {"check": "megatron-core on CUDA, no CPU shims", "ok": not applied and torch.cuda.is_available(),
            "detail": f"megatron-core {megatron.core.__version__}, torch {torch.__version__}, "
                      f"{torch.cuda.get_device_name()}, shims applied: {applied}"}  # fmt: skip


def check_logits(work: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.bridge.hf_config import transformers_config
    from megatron_dapo.bridge.load import load_hf_into_model
    from megatron_dapo.config import ArchConfig, load_config

    arch = ArchConfig(**SMALL_QWEN2)
    arch_file = work / "smoke-qwen2.yaml"
    import yaml

    arch_file.write_text(yaml.safe_dump(SMALL_QWEN2))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(transformers_config(arch, "float32")).eval()
    hf.save_pretrained(work / "smoke-qwen2-hf")
    actor = MegatronActor(load_config("demo_cpu", [f"model.arch={arch_file}", "model.dtype=fp32",
                                                   "model.tokenizer=char"]))  # fmt: skip
    load_hf_into_model(actor.model, arch, work / "smoke-qwen2-hf", te=actor.te)
    tokens = torch.randint(0, arch.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))
    from megatron_dapo.actor.actor import Sequence

    seqs = [Sequence(t, prompt_len=1) for t in tokens]
    ours = actor.compute_logprobs(seqs)
    with torch.no_grad():
        ref = hf.cuda()(tokens.cuda()).logits.float().log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None].cuda())
    gap = max(float((a.cuda() - b[:, 0]).abs().max()) for a, b in zip(ours, ref))
    del actor
    return {"check": "Megatron vs HF logprobs, small Qwen2 (fp32)", "ok": gap < 1e-3,
            "detail": f"max |Δ logprob| = {gap:.2e} over {tokens.numel() - 4} tokens"}  # fmt: skip


def check_train_step(args) -> tuple[dict, dict]:
    import torch

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.memory import GiB, actor_memory, total_params

    cfg = train_config(args, args.arch)
    actor = MegatronActor(cfg)
    n_params = total_params(actor.arch)
    actor.train_step(make_sequences(args, actor.arch.vocab_size, seed=0))  # warm-up: kernels, allocator, Adam
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    seconds, tokens = [], 0
    for k in range(args.steps):
        seqs = make_sequences(args, actor.arch.vocab_size, seed=k + 1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        actor.train_step(seqs)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        tokens = sum(int(s.tokens.numel()) for s in seqs)
    per_step = sorted(seconds)[len(seconds) // 2]
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), 989.0)
    # one training forward + backward over every token (6·N), plus the π_old pass of later mini-batches (none here)
    mfu = 6 * n_params * tokens / per_step / (peak * 1e12)
    measured = torch.cuda.max_memory_allocated()
    predicted = actor_memory(actor.arch, actor.micro_batch_tokens, cfg.max_seq_len, dtype_bytes=2,
                             layout=actor.geometry.layout, logprob_chunk_tokens=cfg.parallel.logprob_chunk_tokens)  # fmt: skip
    spec = "TE" if actor.te else "local spec, shared-prompt rows"
    speed = {"check": f"DAPO train step, {args.arch} shape, bf16 ({spec})", "ok": True,
             "detail": f"{tokens / per_step:,.0f} tokens/s, MFU {mfu:.1%} (peak {peak:g} TFLOP/s), "
                       f"{per_step:.2f} s/step for {len(seqs)} sequences / {tokens:,} tokens"}  # fmt: skip
    ratio = measured / max(predicted.total - predicted.base, 1)
    memory = {"check": "peak memory vs the memory model", "ok": ratio <= 1.0,
              "detail": f"measured {measured / GiB:.2f} GiB, predicted {(predicted.total - predicted.base) / GiB:.2f} "
                        f"GiB without the process base ({predicted.explain()}): {ratio:.2f}×"}  # fmt: skip
    del actor
    torch.cuda.empty_cache()
    return speed, memory


def serialize_once_per_consumer(payload, consumers: int) -> tuple[list, str]:
    """SGLang's MultiprocessingSerializer when sglang is importable, else torch's ForkingPickler (which it wraps)."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer

        return [MultiprocessingSerializer.serialize(payload, output_str=True) for _ in range(consumers)], "sglang"
    except ImportError:
        import base64
        import io

        from torch.multiprocessing.reductions import ForkingPickler

        out = []
        for _ in range(consumers):
            buf = io.BytesIO()
            ForkingPickler(buf).dump(payload)
            out.append(base64.b64encode(buf.getvalue()).decode())
        return out, "torch ForkingPickler (sglang not installed)"


def _receiver(blob: str, queue) -> None:  # in the second process: rebuild the shared bucket and checksum it
    import base64
    import pickle

    import torch

    payload = pickle.loads(base64.b64decode(blob))
    flat = payload["flattened_tensor"]
    queue.put((str(flat.device), float(flat.double().sum()), float((flat.double() * torch.arange(
        flat.numel(), device=flat.device, dtype=torch.float64).remainder(1021).add(1)).sum())))  # fmt: skip


def check_ipc() -> dict:
    import torch
    import torch.multiprocessing as mp

    g = torch.Generator(device="cuda").manual_seed(0)
    named = [(f"w{i}", torch.randn(s, device="cuda", generator=g).to(torch.bfloat16)) for i, s in
             enumerate([(256, 128), (128,), (512, 64)])]  # fmt: skip
    flat = torch.cat([t.reshape(-1) for _, t in named])
    meta = [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype)} for n, t in named]
    payload = {"flattened_tensor": flat, "metadata": meta}
    torch.cuda.synchronize()
    weights = torch.arange(flat.numel(), device="cuda", dtype=torch.float64).remainder(1021).add(1)
    expected = (float(flat.double().sum()), float((flat.double() * weights).sum()))
    blobs, how = serialize_once_per_consumer(payload, consumers=2)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    results = []
    for blob in blobs:  # two consumers, each with its own serialization of the same storage
        p = ctx.Process(target=_receiver, args=(blob, queue))
        p.start()
        results.append(queue.get(timeout=120))
        p.join(60)
    ok = all(dev.startswith("cuda") and abs(a - expected[0]) <= 1e-9 * max(1, abs(expected[0]))
             and abs(b - expected[1]) <= 1e-9 * max(1, abs(expected[1])) for dev, a, b in results)  # fmt: skip
    return {"check": "CUDA-IPC hand-off of a flattened bucket", "ok": ok,
            "detail": f"{flat.numel() * 2 / 1e6:.2f} MB bf16 to 2 processes, one serialization each ({how}); "
                      f"checksums {'equal' if ok else 'DIFFER'}"}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------------


def cpu_check(args) -> int:
    """On a CPU: the configurations build and the train-step shape fits the memory model's arithmetic."""
    from megatron_dapo.config import ArchConfig, load_arch
    from megatron_dapo.memory import actor_memory

    cfg = train_config(args, args.arch)
    arch = load_arch(cfg.model.arch)
    ArchConfig(**SMALL_QWEN2)
    mem = actor_memory(arch, cfg.parallel.max_auto_micro_batch_tokens, cfg.max_seq_len, dtype_bytes=2)
    seqs = make_sequences(args, arch.vocab_size)
    print(f"cpu-check: {args.arch}, {len(seqs)} sequences, {sum(int(s.tokens.numel()) for s in seqs):,} tokens per "
          f"step; predicted {mem.explain()}")  # fmt: skip
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_check:
        return cpu_check(args)
    import torch

    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device (use --cpu-check on a CPU)", file=sys.stderr)
        return 2
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    rows = [check_no_shims()]
    with tempfile.TemporaryDirectory() as work:
        from megatron_dapo.actor.dist import teardown

        rows.append(check_logits(Path(work)))
        teardown()
        rows += list(check_train_step(args))
        teardown()
    rows.append(check_ipc())
    table = ["| check | result | detail |", "|---|---|---|"]
    table += [f"| {r['check']} | {'ok' if r['ok'] else 'FAILED'} | {r['detail']} |" for r in rows]
    text = f"GPU smoke, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}\n\n" + "\n".join(table) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_smoke.md").write_text(text)
    (out / "gpu_smoke.json").write_text(json.dumps(rows, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    from megatron_dapo.config import ConfigError

    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
