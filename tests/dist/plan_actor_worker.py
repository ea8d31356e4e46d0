"""Per-rank parameter / gradient / optimizer bytes of a real MegatronActor after one update (for the planner test).

torchrun --nproc-per-node TP*PP tests/dist/plan_actor_worker.py OUT.json ARCH.yaml[,ARCH2.yaml...] TP PP

Several architectures run one after the other in the same ranks (one launch per layout): OUT.json maps each to its rows.
"""

import json
import sys

import torch
import torch.distributed as dist


def main(out: str, archs: str, tp: int, pp: int) -> None:
    result = {arch: measure(arch, tp, pp) for arch in archs.split(",")}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def measure(arch: str, tp: int, pp: int) -> list[dict]:
    from megatron.core import parallel_state as ps

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.types import Sequence
    from megatron_dapo.config.run_config import load_config

    cfg = load_config("demo_cpu", [f"model.arch={arch}", f"parallel.tp={tp}", f"parallel.pp={pp}"])
    actor = MegatronActor(cfg)
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(torch.randint(0, 32, (12,), generator=g), prompt_len=4) for _ in range(4)]
    actor.supervised_step(seqs, lr=1e-3)  # Adam allocates its moments at the first update
    params = [p for m in actor.model for p in m.module.parameters()]
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for m in actor.model for b in m.buffers)
    opts = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    opt_bytes = sum(
        t.numel() * t.element_size()
        for o in opts
        for st in o.optimizer.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    row = {
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "params": sum(p.numel() for p in params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "grad_bytes": grad_bytes,
        "optimizer_bytes": opt_bytes,
    }
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
