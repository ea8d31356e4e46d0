#!/usr/bin/env python
"""GPU smoke test on one GPU (two for the IPC check when present), in minutes. Needs only PyTorch (CUDA) and
megatron-core; uses Transformer Engine and SGLang when importable, and says which parts it skipped without them.

    python tools/gpu_smoke.py [--out DIR] [--seconds 420]      # make gpu-smoke
    python tools/gpu_smoke.py --cpu-check                     # on a CPU: arguments, model builds, the IPC contract

Checks, each a row of the table it prints (and writes to --out/gpu_smoke.{md,json}):
1. megatron-core runs on CUDA with none of the CPU shims of ``actor/cpu.py`` applied;
2. the bridge: Megatron logits equal HF transformers' on a small random Qwen2 built here (fp32, loaded through
   ``bridge.load_hf_into_model``), max |Δlogit|;
3. a DAPO ``train_step`` (bf16) on a Qwen2.5-0.5B-shaped model with random weights: tokens/s and model FLOPs
   utilisation (6·N·tokens / time / peak; attention FLOPs not counted), on the layer spec the machine gives (TE if
   installed, else megatron-core's local spec with shared-prompt rows);
4. its peak memory (torch.cuda.max_memory_allocated) against the actor's memory model (``memory.actor_memory``);
5. with Transformer Engine: step 3 ran on TE's spec with THD-packed rows; the same step in FP8 (e4m3) on a GPU
   with FP8 tensor cores;
6. the weight-bucket hand-off of the ``tensor`` transport (``ipc_contract``): the payload ``TensorSync.serialize``
   builds (``FlattenedTensorBucket`` + ``FlattenedTensorMetadata``, SGLang's ``MultiprocessingSerializer``, the
   device-UUID patch of ``monkey_patch_torch_reductions`` on CUDA), one serialization per TP rank, each read in
   another process (on GPU i when there are two) by SGLang's ``SafeUnpickler`` and ``FlattenedTensorBucket``
   loader, as its TP worker does, and checksummed per tensor. ``--cpu-check`` runs it on shared-memory storages.
   Without sglang: torch's ForkingPickler and dict metadata, reported as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
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


def train_config(args, arch_name: str, extra: list[str] | None = None):
    from megatron_dapo.config.run_config import load_config

    seqs = args.groups * args.group
    return load_config("demo_cpu", [
        f"model.arch={arch_name}", "model.dtype=bf16", "model.tokenizer=char", "algo.dynamic_sampling=false",
        f"algo.group_size={args.group}", f"train.batch_prompts={args.groups}", f"train.mini_batch_prompts={args.groups}",
        f"algo.gen_batch_prompts={args.groups}", f"data.max_prompt_len={args.prompt_len}",
        f"rollout.sampling.max_new_tokens={args.response_len}", "train.lr=1e-6", "train.min_lr=null",
        f"train.steps={args.steps + 1}",
        f"parallel.max_auto_micro_batch_tokens={max(8192, 2 * (args.prompt_len + seqs * args.response_len // 8))}",
        *(extra or []),
    ])  # fmt: skip


def make_sequences(args, vocab: int, seed: int = 0):
    import torch

    from megatron_dapo.types import Sequence

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
    from megatron_dapo.bridge.load import load_hf_into_model
    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.models.arch import ArchConfig
    from megatron_dapo.models.hf_config import transformers_config

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
    from megatron_dapo.types import Sequence

    seqs = [Sequence(t, prompt_len=1) for t in tokens]
    ours = actor.compute_logprobs(seqs)
    with torch.no_grad():
        ref = hf.cuda()(tokens.cuda()).logits.float().log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None].cuda())
    gap = max(float((a.cuda() - b[:, 0]).abs().max()) for a, b in zip(ours, ref))
    del actor
    return {"check": "Megatron vs HF logprobs, small Qwen2 (fp32)", "ok": gap < 1e-3,
            "detail": f"max |Δ logprob| = {gap:.2e} over {tokens.numel() - 4} tokens"}  # fmt: skip


def check_train_step(args, extra: list[str] | None = None) -> tuple[dict, dict]:
    import torch

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.models.memory import GiB, actor_memory, total_params

    cfg = train_config(args, args.arch, extra)
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


def have(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _checksums(named) -> dict[str, tuple[float, float]]:
    """Per tensor: (sum, position-weighted sum) in float64, wherever the tensor lives."""
    import torch

    out = {}
    for name, t in named:
        x = t.detach().reshape(-1).double()
        w = torch.arange(x.numel(), device=x.device, dtype=torch.float64).remainder(1021).add(1)
        out[name] = (float(x.sum().cpu()), float((x * w).sum().cpu()))
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(x - y) <= 1e-9 * max(1.0, abs(y)) for k in a for x, y in zip(a[k], b[k]))


def _consume(blobs: list, device: str, how: str, queue) -> None:
    """The receiving process, as SGLang's TP worker reads its own serialization (``tp_worker.py``
    ``deserialize_own_rank``: the device-UUID patch on CUDA, ``MultiprocessingSerializer.deserialize`` = its
    ``SafeUnpickler``; then ``FlattenedTensorBucket(flattened_tensor=, metadata=).reconstruct_tensors()``)."""
    try:
        import torch

        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        got = []
        for blob in blobs:
            if how == "sglang":
                from sglang.srt.utils import MultiprocessingSerializer
                from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

                if device.startswith("cuda"):
                    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

                    monkey_patch_torch_reductions()
                data = MultiprocessingSerializer.deserialize(blob)
                fb = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
                named = fb.reconstruct_tensors()
            else:  # torch alone: a dict of views over the flat tensor
                import base64
                import pickle

                data = pickle.loads(base64.b64decode(blob))
                flat, named, at = data["flattened_tensor"], [], 0
                for m in data["metadata"]:
                    n = int(torch.Size(m["shape"]).numel())
                    named.append((m["name"], flat[at : at + n].view(m["shape"])))
                    at += n
            got.append((sorted({str(t.device) for _, t in named}), _checksums(named)))
        queue.put(("ok", got))
    except Exception as e:  # noqa: BLE001 - reported in the table
        queue.put(("error", f"{type(e).__name__}: {e}"))


def ipc_contract(device: str, consumers: int = 2) -> tuple[dict, list[str]]:
    """A weight bucket handed to ``consumers`` other processes (TP ranks; on CUDA one per GPU when there are that
    many) the way the ``tensor`` transport does it: the payload our ``TensorSync.serialize`` builds (one
    ``FlattenedTensorBucket``, its ``FlattenedTensorMetadata``, the device-UUID patch on CUDA, SGLang's
    ``MultiprocessingSerializer``), one serialization per consumer, each read back by SGLang's safe unpickler and
    loader in the consumer and checksummed against the sender. Without sglang: torch's ForkingPickler and a dict of
    metadata (the row says so). Returns (row, what was skipped)."""
    import torch
    import torch.multiprocessing as mp

    skipped = []
    g = torch.Generator().manual_seed(0)
    bucket = [(f"model.layers.{i}.w", torch.randn(*shape, generator=g)) for i, shape in
              enumerate([(256, 128), (128,), (512, 64)])]  # fmt: skip
    cuda = device.startswith("cuda")
    gpus = torch.cuda.device_count() if cuda else 0
    if cuda and gpus < 2:
        skipped.append("a consumer on a second GPU (one GPU here)")
    # TP rank i's serialization is made on GPU i (per-GPU senders, node_sync.py), read by a process on GPU i
    homes = [f"cuda:{i % gpus}" if cuda else "cpu" for i in range(consumers)]
    payloads, blobs = [], []
    if have("sglang"):
        from megatron_dapo.engines.sglang.client import SGLangEngine
        from megatron_dapo.engines.sglang.server import SGLangServer
        from megatron_dapo.engines.sglang.sync import TensorSync

        how = "sglang"
        engine = SGLangEngine([SGLangServer.attach("http://127.0.0.1:9", tp_size=consumers, device=device)],
                              dtype="bfloat16", start=False)  # fmt: skip  # never contacted
        sync = TensorSync(engine, verify="off")
        for home in homes:  # one per consumer (TP rank), never one blob shared
            with torch.cuda.device(home) if cuda else contextlib.nullcontext():
                payload, blob, _ = sync.serialize(bucket)
            payloads.append(payload)
            blobs.append(blob)
        engine.shutdown(stop_servers=False)
        what = "FlattenedTensorBucket + SGLang's MultiprocessingSerializer / SafeUnpickler"
        what += " + device-UUID patch" if cuda else ""
    else:
        import base64
        import io

        from torch.multiprocessing.reductions import ForkingPickler

        how = "torch"
        skipped.append("SGLang's transport contract (sglang not importable): torch's ForkingPickler + dict metadata")
        for home in homes:
            named = [(n, t.to(home, torch.bfloat16)) for n, t in bucket]
            payloads.append({"flattened_tensor": torch.cat([t.reshape(-1) for _, t in named]),
                             "metadata": [{"name": n, "shape": list(t.shape)} for n, t in named]})  # fmt: skip
            buf = io.BytesIO()
            ForkingPickler(buf).dump(payloads[-1])
            blobs.append(base64.b64encode(buf.getvalue()).decode())
        what = "torch ForkingPickler"
    sent = _checksums([(n, t.to(torch.bfloat16)) for n, t in bucket])
    if cuda:
        targets = [(home, [blob]) for home, blob in zip(homes, blobs)]
    else:
        targets = [("cpu", blobs)]  # one reading process for every TP rank's blob (shared-memory files)
    ctx = mp.get_context("spawn")
    results = []
    for dev, mine in targets:
        queue = ctx.Queue()
        proc = ctx.Process(target=_consume, args=(mine, dev, how, queue))
        proc.start()
        results.append((dev, queue.get(timeout=300)))
        proc.join(60)
    errors = [f"{dev}: {r[1]}" for dev, r in results if r[0] != "ok"]
    read = [(dev, devs, sums) for dev, r in results if r[0] == "ok" for devs, sums in r[1]]
    ok = not errors and len(read) == consumers
    ok = ok and all(devs == [dev] and same(sums, sent) for dev, devs, sums in read)
    del payloads
    where = sorted({dev for dev, _ in targets})
    detail = (f"{len(bucket)} tensors bf16 to {consumers} TP ranks in {len(targets)} process(es) on {where}, one "
              f"serialization each ({what}); checksums {'equal' if ok else 'DIFFER'}")  # fmt: skip
    if errors:
        detail += f"; {'; '.join(errors)}"
    return {"check": f"weight-bucket hand-off to other processes ({device})", "ok": ok, "detail": detail}, skipped


def check_te_fp8(args) -> tuple[list[dict], list[str]]:
    """One GPU, Transformer Engine importable: the train step above ran on TE's spec with THD-packed rows; here the
    same step in FP8 (e4m3, delayed scaling) when the GPU has FP8 tensor cores (compute capability >= 8.9)."""
    import torch

    if not have("transformer_engine"):
        return [], ["the THD-packed Transformer Engine step and its FP8 variant (transformer_engine not importable)"]
    if torch.cuda.get_device_capability() < (8, 9):
        return [], [f"the FP8 step ({torch.cuda.get_device_name()} has no FP8 tensor cores)"]
    speed, _ = check_train_step(args, ["model.fp8=e4m3"])
    speed["check"] = speed["check"].replace("bf16", "FP8 e4m3")
    return [speed], []


# ----------------------------------------------------------------------------------------------------------------------


def cpu_check(args) -> int:
    """On a CPU: the configurations build and the train-step shape fits the memory model's arithmetic."""
    from megatron_dapo.models.arch import ArchConfig, load_arch
    from megatron_dapo.models.memory import actor_memory

    cfg = train_config(args, args.arch)
    arch = load_arch(cfg.model.arch)
    ArchConfig(**SMALL_QWEN2)
    mem = actor_memory(arch, cfg.parallel.max_auto_micro_batch_tokens, cfg.max_seq_len, dtype_bytes=2)
    seqs = make_sequences(args, arch.vocab_size)
    print(f"cpu-check: {args.arch}, {len(seqs)} sequences, {sum(int(s.tokens.numel()) for s in seqs):,} tokens per "
          f"step; predicted {mem.explain()}")  # fmt: skip
    row, skipped = ipc_contract("cpu")  # the transport contract on shared-memory storages
    print(f"cpu-check: {row['check']}: {'ok' if row['ok'] else 'FAILED'}: {row['detail']}")
    for part in skipped:
        print(f"cpu-check: skipped {part}")
    return 0 if row["ok"] else 1


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
        fp8, skipped = check_te_fp8(args)
        rows += fp8
        teardown()
    ipc, more = ipc_contract("cuda", consumers=2)
    rows.append(ipc)
    skipped += more
    table = ["| check | result | detail |", "|---|---|---|"]
    table += [f"| {r['check']} | {'ok' if r['ok'] else 'FAILED'} | {r['detail']} |" for r in rows]
    text = f"GPU smoke, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}\n\n" + "\n".join(table) + "\n"
    text += "".join(f"\nskipped: {part}" for part in skipped) + ("\n" if skipped else "")
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_smoke.md").write_text(text)
    (out / "gpu_smoke.json").write_text(json.dumps({"rows": rows, "skipped": skipped}, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    from megatron_dapo.config.typed_yaml import ConfigError

    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
