"""``save_hf_checkpoint`` from a TP=2 x PP=2 actor (torchrun, 4 ranks, gloo): the shards rank 0 writes hold exactly
what ``export_hf_tensors`` gives rank 0. ``python hf_export_worker.py OUT_DIR``; rank 0 writes OUT_DIR/result.json."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(out: Path) -> None:
    from safetensors.torch import load_file

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.bridge.export import export_hf_tensors, export_plan, save_hf_checkpoint
    from megatron_dapo.config.run_config import load_config

    cfg = load_config("demo_cpu", ["parallel.tp=2", "parallel.pp=2"])
    actor = MegatronActor(cfg)
    with torch.no_grad():  # distinct values on every rank's shard: a tensor from the wrong rank shows
        for p in actor.model[0].parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(dist.get_rank())))
    save_hf_checkpoint(actor.model, actor.arch, out / "hf", max_shard_size=40_000)
    want = {n: t.clone() for bucket in export_hf_tensors(actor.model, actor.arch) for n, t in bucket}
    if dist.get_rank() == 0:
        files = sorted((out / "hf").glob("*.safetensors"))
        got = {n: t for f in files for n, t in load_file(f).items()}
        plan = export_plan(actor.arch, 2, 2, dtype=next(iter(want.values())).dtype, max_shard_size=40_000)
        result = {"files": len(files), "planned": plan.shards, "names_equal": sorted(got) == sorted(want),
                  "equal": all(torch.equal(got[n], want[n]) for n in want if n in got), "tensors": len(want),
                  "index": (out / "hf" / "model.safetensors.index.json").is_file()}  # fmt: skip
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
