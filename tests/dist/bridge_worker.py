"""torchrun worker of tests/dist/test_bridge_dist.py: load a converted checkpoint into MegatronActor at TP×PP, compare
every parameter shard with the offline split of the HF weights, export HF tensors from the live model (each receiver
mode: rank 0, each stage, every rank) and compare with the HF checkpoint, then save with the actor (for the
Megatron → HF check in the parent). Several checkpoints (one per architecture) run one after the other in one launch:
``--hf A B --ckpt A B --save A B`` (results ``RESULT.<case>.<rank>.json``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist


def hf_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True, nargs="+")
    ap.add_argument("--ckpt", required=True, nargs="+")
    ap.add_argument("--save", required=True, nargs="+")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--result", required=True)
    args = ap.parse_args()
    for case, (hf, ckpt, save) in enumerate(zip(args.hf, args.ckpt, args.save, strict=True)):
        problems = check_case(Path(hf), ckpt, save, args.tp, args.pp)
        Path(args.result).with_suffix(f".{case}.{dist.get_rank()}.json").write_text(json.dumps(problems))
        dist.barrier()
    dist.destroy_process_group()


def check_case(hf_dir: Path, ckpt: str, save: str, tp: int, pp: int) -> list[str]:
    from megatron.core import parallel_state as ps

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.bridge.convert import read_meta
    from megatron_dapo.bridge.export import export_hf_tensors
    from megatron_dapo.models.registry import table_for
    from megatron_dapo.bridge.reshard import split_model
    from megatron_dapo.config.run_config import DapoConfig

    arch, _ = read_meta(ckpt)
    cfg = DapoConfig()
    cfg.parallel.tp, cfg.parallel.pp, cfg.model.dtype = tp, pp, "fp32"
    actor = MegatronActor(cfg, arch)
    actor.load(ckpt, load_optimizer=False)
    problems = []

    hf = hf_state(hf_dir)
    full = table_for(arch).hf_to_megatron(hf, arch)
    stage, rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    expected = split_model(full, arch, tp, pp)[stage, 0, rank]
    got = dict(actor.model[0].module.named_parameters())
    if set(got) != set(expected):
        problems.append(f"parameter names differ: {sorted(set(got) ^ set(expected))}")
    for name, t in got.items():
        if name in expected and not torch.equal(t.detach(), expected[name]):
            problems.append(f"{name}: loaded shard differs (max {float((t - expected[name]).abs().max()):.3g})")

    for dst in ("rank0", "stage", "all"):
        received, limit = {}, 32 << 10
        for bucket in export_hf_tensors(actor.model, arch, bucket_bytes=limit, dst=dst):
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            if size > limit and len(bucket) > 1:
                problems.append(f"{dst}: bucket of {size} bytes > {limit} with {len(bucket)} tensors")
            for name, t in bucket:
                if name in received:
                    problems.append(f"{dst}: {name} received twice")
                received[name] = t
        want = [n for n in hf if not (arch.tie_embeddings and n == "lm_head.weight")]
        if dst == "rank0":
            want = want if dist.get_rank() == 0 else []
        elif dst == "all":  # every rank: the whole model (the per-node weight sync)
            pass
        else:
            want = [n for n in want if rank == 0 and _stage_of_hf(n, arch, pp) == stage]
        if sorted(received) != sorted(want):
            problems.append(f"{dst}: rank {dist.get_rank()} received {sorted(received)}, expected {sorted(want)}")
        for name, t in received.items():
            if name in hf and not torch.equal(t, hf[name]):
                problems.append(f"{dst}: {name} differs from the HF tensor")

    actor.save(save)
    return problems


def _stage_of_hf(name: str, arch, pp: int) -> int:
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) // (arch.num_layers // pp)
    return 0 if name == "model.embed_tokens.weight" else pp - 1


if __name__ == "__main__":
    main()
