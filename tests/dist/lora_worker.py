"""Worker for the LoRA tests: ``torchrun --nproc-per-node N tests/dist/lora_worker.py PLAN.json`` runs each
``[scenario, out, [k=v...]]`` of the plan in order, each with its own actor (the actor tests' config and sequences:
``actor_worker.py``). Rank 0 writes each result to ``out`` as a torch file.

- ``logprobs``: the actor's logprobs on the fixed sequences.
- ``train``: two DAPO updates (the first moves only B, A's gradient being B^T(...) = 0 at B = 0; the second moves
  both), then the logprobs, the merged weights the bridge exports (rank 0 receives them whole), the adapters' and the
  base's parameters (this rank's, to check that the base stayed frozen).

``hf=DIR``: then the model (merged, if adapted) is written as an HF checkpoint; ``save=DIR`` / ``load=DIR``: the
actor's checkpoint (megatron dist_checkpointing: resharded on load); ``peft=DIR``: the adapters as a PEFT folder.
"""

import gc
import json
import sys

import torch
from actor_worker import make_cfg, make_seqs, train_once


def run(scenario: str, out: str, args: list[str]) -> None:
    import torch.distributed as dist

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.bridge.export import export_hf_tensors, save_hf_checkpoint
    from megatron_dapo.bridge.load import load_checkpoint, load_hf_into_model
    from megatron_dapo.bridge.peft import save_peft_adapter

    kv = dict(a.split("=", 1) for a in args)
    hf, save, load, peft = (kv.pop(k, None) for k in ("hf", "save", "load", "peft"))
    cfg = make_cfg(**{"train.adam_eps": 1e-3, **kv})
    actor = MegatronActor(cfg)
    if cfg.model.hf_init:  # as the trainer starts from model.hf_init (loop/trainer.py)
        load_hf_into_model(actor.model, actor.arch, cfg.model.hf_init, te=actor.te)
    if load:  # a checkpoint of the actor (the adapters, with their base read where the checkpoint names it)
        load_checkpoint(actor, load)
    seqs = make_seqs()
    result = {"trainable": sorted(n for n, p in actor.named_parameters() if p.requires_grad)}
    result["lora_params"] = sum(p.numel() for n, p in actor.named_parameters() if ".lora_" in n)  # rank 0's
    if scenario == "train":
        before = {n: p.detach().clone() for n, p in actor.named_parameters()}
        result["metrics"] = [train_once(actor, seqs), train_once(actor, seqs)]
        result["changed"] = sorted(n for n, p in actor.named_parameters() if not torch.equal(p, before[n]))
    elif scenario != "logprobs":
        raise ValueError(f"unknown scenario {scenario!r}")
    if hf:
        save_hf_checkpoint(actor.model, actor.arch, hf)
    if save:
        actor.save(save)
    if peft:
        save_peft_adapter(actor.model, actor.arch, cfg.model.lora, peft)
    result["logprobs"] = actor.compute_logprobs(seqs)
    result["merged"] = {n: t.clone() for bucket in export_hf_tensors(actor.model, actor.arch) for n, t in bucket}
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.barrier()


def main():
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    for scenario, out, args in plan:
        run(scenario, out, args)
        gc.collect()


if __name__ == "__main__":
    main()
