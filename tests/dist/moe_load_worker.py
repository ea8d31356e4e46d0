"""torchrun worker of tests/dist/test_moe_bridge.py: HF weights loaded into megatron-core's MoE model at TP x EP x PP,
every rank's parameters (names and values) equal to the offline split ``split_model(...)[stage, ep_rank, tp_rank]``;
the live export (``export_hf_tensors``, each ``dst``) gives back every HF tensor, experts included, to its receivers."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def main(hf_dir: str, tp: int, ep: int, pp: int, out: str) -> None:
    from megatron.core import parallel_state as ps

    from megatron_dapo.actor.dist import init_distributed, seed_everything
    from megatron_dapo.actor.provider import build_model
    from megatron_dapo.bridge.convert import hf_weight_files, read_st_header, read_st_tensor
    from megatron_dapo.bridge.load import load_hf_into_model
    from megatron_dapo.bridge.reshard import split_model
    from megatron_dapo.config.run_config import ModelConfig, ParallelConfig
    from megatron_dapo.models.hf_config import arch_from_hf, read_hf_config
    from megatron_dapo.models.registry import table_for

    parallel = ParallelConfig(tp=tp, pp=pp, ep=ep)
    init_distributed(parallel)
    seed_everything(0)
    arch = arch_from_hf(read_hf_config(hf_dir))
    chunks = build_model(arch, ModelConfig(dtype="fp32"), parallel, training=False)
    load_hf_into_model(chunks, arch, hf_dir)
    hf = {}
    for f in hf_weight_files(__import__("pathlib").Path(hf_dir)):
        hf.update({n: read_st_tensor(e) for n, e in read_st_header(f).items()})
    full = table_for(arch).hf_to_megatron(hf, arch)
    key = (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
    )
    expected = split_model(full, arch, tp, pp, ep=ep)[key]
    got = dict(chunks[0].named_parameters())
    problems = []
    if set(got) != set(expected):
        problems.append(f"rank {dist.get_rank()} {key}: names differ: {sorted(set(got) ^ set(expected))[:4]}")
    for name, t in got.items():
        if name in expected and not torch.equal(t.detach(), expected[name]):
            problems.append(f"rank {dist.get_rank()} {key}: {name} differs")
    from megatron_dapo.bridge.export import export_hf_tensors

    first_of_stage = (
        ps.get_data_parallel_rank(with_context_parallel=True) == 0 and ps.get_tensor_model_parallel_rank() == 0
    )
    for dst in ("rank0", "stage", "all"):
        got_hf = {n: t for bucket in export_hf_tensors(chunks, arch, bucket_bytes=4096, dst=dst) for n, t in bucket}
        if dst == "all" or (dst == "rank0" and dist.get_rank() == 0):
            want = set(hf)
        elif dst == "stage" and first_of_stage:
            want = {h for p in table_for(arch).params(arch) for h in p.hf if _stage(p, arch, pp) == key[0]}
        else:
            want = set()
        if set(got_hf) != want:
            problems.append(f"rank {dist.get_rank()} {dst}: got {len(got_hf)} tensors, want {len(want)}: "
                            f"{sorted(set(got_hf) ^ want)[:3]}")  # fmt: skip
        problems += [f"rank {dist.get_rank()} {dst}: {n} differs" for n in got_hf if not torch.equal(got_hf[n], hf[n])]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (key, len(got), problems))
    if dist.get_rank() == 0:
        torch.save(every, out)
    dist.barrier()
    dist.destroy_process_group()


def _stage(p, arch, pp: int) -> int:
    if p.layer is not None:
        return p.layer // (arch.num_layers // pp)
    return 0 if p.megatron.startswith("embedding.") else pp - 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
