#!/usr/bin/env python
"""HF → Megatron → HF conversion of a synthetic ~1B-parameter Qwen2 checkpoint vs raw safetensors read+write.

    python bench/bench_bridge.py [--layers 20] [--shard-mb 512] [--dir /tmp/bench_bridge] [--keep]

One run, each phase in its own process (so peak RSS is per phase):
  make        random bf16 weights, sharded safetensors + index + config.json (not timed against anything)
  raw         the same bytes read (plain reads) and written (safetensors, fsync) twice: HF → A → B
  to_megatron tools' hf_to_megatron (one dist_checkpointing part per HF shard, merged)
  to_hf       tools' megatron_to_hf (bucketed loads, streamed safetensors shards of the same size as the input's)
  verify      the round trip is bit-exact (not timed)
Printed: time ratio (goal ≤ 1.3×; the median of ``--repeat`` interleaved rounds, as disk speed drifts) and peak RSS
per phase vs largest shard + one bucket + 20% (goal), next to the RSS of a process that only imports torch +
megatron-core (what every phase pays anyway). Forked dist_checkpointing writer processes are reported separately
(they share the parent's pages copy-on-write).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

BUCKET = 512 << 20


def arch_for(layers: int):
    from megatron_dapo.models.arch import ArchConfig

    return ArchConfig(
        name="bench-1b", family="qwen2", num_layers=layers, hidden_size=2048, ffn_hidden_size=5632,
        num_attention_heads=16, num_query_groups=2, vocab_size=32000, max_position_embeddings=4096,
        qkv_bias=True, tie_embeddings=False,
    )  # fmt: skip


def phase_make(d: Path, layers: int, shard_mb: int) -> dict:
    import torch
    from safetensors.torch import save_file

    from megatron_dapo.models.hf_config import hf_from_arch
    from megatron_dapo.models.registry import table_for

    arch = arch_for(layers)
    hf = d / "hf"
    shutil.rmtree(hf, ignore_errors=True)
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps(hf_from_arch(arch, "bfloat16"), indent=2))
    g = torch.Generator().manual_seed(0)
    shards, cur, size, weight_map, total = [], {}, 0, {}, 0

    def flush():
        nonlocal cur, size
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(cur, str(hf / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in cur})
        shards.append(name)
        cur, size = {}, 0

    for name, shape in table_for(arch).hf_shapes(arch).items():
        t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        if cur and size + t.numel() * 2 > shard_mb << 20:
            flush()
        cur[name] = t
        size += t.numel() * 2
        total += t.numel() * 2
    flush()
    n = len(shards)
    for i, name in enumerate(shards):  # final names model-0000i-of-0000n
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (hf / name).rename(hf / final)
        weight_map = {k: (final if v == name else v) for k, v in weight_map.items()}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    params = total // 2
    return {
        "params": params,
        "bytes": total,
        "shards": n,
        "largest_shard": max(f.stat().st_size for f in hf.glob("*.safetensors")),
    }


def phase_raw(d: Path) -> dict:
    from safetensors.torch import save_file

    from megatron_dapo.bridge.convert import read_st_header, read_st_tensor

    src = d / "hf"
    for dst_name in ("raw_a", "raw_b"):
        dst = d / dst_name
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir()
        for f in sorted(src.glob("*.safetensors")):
            with open(f, "rb") as fh:
                data = {n: read_st_tensor(e, fh) for n, e in read_st_header(f).items()}
            save_file(data, str(dst / f.name), metadata={"format": "pt"})
            with open(dst / f.name, "rb+") as out:
                os.fsync(out.fileno())
            del data
        src = dst
    return {}


def phase_to_megatron(d: Path) -> dict:
    from megatron_dapo.bridge.convert import hf_to_megatron

    shutil.rmtree(d / "mg", ignore_errors=True)
    hf_to_megatron(d / "hf", d / "mg")
    return {}


def phase_to_hf(d: Path, shard_mb: int) -> dict:
    from megatron_dapo.bridge.convert_to_hf import megatron_to_hf

    shutil.rmtree(d / "back", ignore_errors=True)
    megatron_to_hf(d / "mg", d / "back", max_shard_size=shard_mb << 20, bucket_bytes=BUCKET)
    return {}


def phase_verify(d: Path) -> dict:
    import torch
    from safetensors import safe_open

    def index(p: Path) -> dict[str, Path]:
        idx = p / "model.safetensors.index.json"
        if idx.is_file():
            return {k: p / v for k, v in json.loads(idx.read_text())["weight_map"].items()}
        with safe_open(p / "model.safetensors", "pt") as f:
            return {k: p / "model.safetensors" for k in f.keys()}

    a, b = index(d / "hf"), index(d / "back")
    assert sorted(a) == sorted(b), "tensor names differ"
    for name, f in a.items():
        with safe_open(f, "pt") as fa, safe_open(b[name], "pt") as fb:
            assert torch.equal(fa.get_tensor(name), fb.get_tensor(name)), name
    return {"tensors": len(a)}


def phase_baseline(d: Path) -> dict:
    import megatron.core.dist_checkpointing  # noqa: F401
    import torch  # noqa: F401

    import megatron_dapo.bridge.convert  # noqa: F401

    return {}


def run_phase(name: str, d: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--phase", name, "--dir", str(d), "--layers", str(args.layers),
           "--shard-mb", str(args.shard_mb)]  # fmt: skip
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"phase {name} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall"] = wall
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=20, help="20 layers ≈ 1.0B parameters")
    ap.add_argument("--shard-mb", type=int, default=512)
    ap.add_argument("--dir", default="/tmp/bench_bridge")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="raw / conversion rounds; the median ratio is reported")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    args = ap.parse_args()
    d = Path(args.dir)
    if args.phase:
        t = time.perf_counter()
        if args.phase in ("to_megatron", "to_hf", "baseline"):  # interpreter start-up is not conversion work
            phase_baseline(d)
        imports = time.perf_counter() - t
        t = time.perf_counter()
        fn = {
            "make": lambda: phase_make(d, args.layers, args.shard_mb),
            "raw": lambda: phase_raw(d),
            "to_megatron": lambda: phase_to_megatron(d),
            "to_hf": lambda: phase_to_hf(d, args.shard_mb),
            "verify": lambda: phase_verify(d),
            "baseline": lambda: phase_baseline(d),
        }[args.phase]
        info = fn()
        info["seconds"] = time.perf_counter() - t
        info["imports"] = imports
        info["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        info["children_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        print(json.dumps(info))
        return

    d.mkdir(parents=True, exist_ok=True)
    made = run_phase("make", d, args)
    print(f"synthetic Qwen2: {made['params'] / 1e9:.2f}B params, {made['bytes'] / 2**30:.2f} GiB bf16, "
          f"{made['shards']} shards (largest {made['largest_shard'] / 2**20:.0f} MiB)")  # fmt: skip
    r = {"baseline": run_phase("baseline", d, args)}
    rounds, ratios = [], []
    for rep in range(args.repeat):  # interleaved, so that disk-speed drift hits both sides alike
        runs = {name: run_phase(name, d, args) for name in ("raw", "to_megatron", "to_hf")}
        rounds.append(runs)
        ratios.append((runs["to_megatron"]["seconds"] + runs["to_hf"]["seconds"]) / runs["raw"]["seconds"])
        secs = ", ".join(f"{name} {out['seconds']:.1f} s" for name, out in runs.items())
        print(f"  repeat {rep + 1}/{args.repeat}: {secs}: ratio {ratios[-1]:.2f}", flush=True)
    median = rounds[sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]]
    for name in ("raw", "to_megatron", "to_hf"):  # the median round's times, the worst RSS of all rounds
        worst = {k: max(x[name][k] for x in rounds) for k in ("rss_mb", "children_rss_mb")}
        r[name] = {**median[name], **worst}
    r["verify"] = run_phase("verify", d, args)
    conv = r["to_megatron"]["seconds"] + r["to_hf"]["seconds"]
    raw = r["raw"]["seconds"]
    goal_rss = (made["largest_shard"] + BUCKET) / 2**20 * 1.2
    gib = made["bytes"] / 2**30
    print(f"raw read+write x2      {raw:7.1f} s   ({2 * gib / raw:.2f} GiB/s)")
    print(
        f"HF -> Megatron         {r['to_megatron']['seconds']:7.1f} s   (+ {r['to_megatron']['imports']:.1f} s importing megatron-core, not counted)"
    )
    print(f"Megatron -> HF         {r['to_hf']['seconds']:7.1f} s")
    spread = f"; {args.repeat} repeats: {min(ratios):.2f}-{max(ratios):.2f}" if args.repeat > 1 else ""
    print(
        f"time ratio             {conv / raw:7.2f} x  (goal <= 1.3; median repeat{spread})   "
        f"round trip bit-exact: {r['verify']['tensors']} tensors"
    )
    print(
        f"peak RSS (MiB; goal <= largest shard + bucket + 20% = {goal_rss:.0f}; imports alone = {r['baseline']['rss_mb']:.0f})"
    )
    for name in ("raw", "to_megatron", "to_hf"):
        extra = f", forked writers {r[name]['children_rss_mb']:.0f}" if r[name]["children_rss_mb"] > 1 else ""
        print(f"  {name:12s} {r[name]['rss_mb']:7.0f}{extra}")
    if not args.keep:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
