"""Worker for the multi-process actor tests: `torchrun --nproc-per-node N tests/dist/actor_worker.py SCENARIO OUT [k=v...]`,
or several scenarios in one launch: `... actor_worker.py --batch PLAN.json` (a JSON list of [SCENARIO, OUT, [k=v...]],
run in order, each with its own actor; megatron's parallel state is rebuilt for each, so TP/PP may differ).

Scenarios write their results (rank 0) to OUT as a torch file; the pytest side compares them.
"""

import gc
import json
import sys

import torch


def make_cfg(**over):
    from megatron_dapo.config.run_config import load_config

    base = {
        "data.synthetic": "add2",
        "train.batch_prompts": 4,
        "train.mini_batch_prompts": 2,
        "algo.group_size": 2,
        "algo.overlong_penalty": False,
        "parallel.max_tokens_per_micro_batch": 64,
        "rollout.sampling.max_new_tokens": 24,
        "data.max_prompt_len": 16,
        "train.lr": 1e-3,
        "train.warmup_steps": 0,
        "train.weight_decay": 0.0,
        "model.arch": "tiny",
    }
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def make_seqs(n=8, seed=0, vocab=32, group=1):
    """``n`` sequences; with ``group`` > 1, consecutive runs of ``group`` share their prompt (as rollout groups do)."""
    from megatron_dapo.types import Sequence

    g = torch.Generator().manual_seed(seed)
    seqs = []
    for k in range(n):
        length = int(torch.randint(10, 40, (1,), generator=g))
        if k % group == 0:
            prompt = torch.randint(0, vocab, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g)
        response = torch.randint(0, vocab, (length - 7,), generator=g)
        seqs.append(
            Sequence(
                tokens=torch.cat([prompt, response]) if group > 1 else torch.randint(0, vocab, (length,), generator=g),
                prompt_len=len(prompt),
                advantage=float(torch.randn(1, generator=g)),
            )
        )
    return seqs


def full_params(actor):
    """Gather this TP=1 model's parameters by name (rank 0 of each PP stage)."""
    return {k: v.detach().clone() for k, v in actor.named_parameters()}


def train_once(actor, seqs):
    for s, lp in zip(seqs, actor.compute_logprobs(seqs)):
        s.old_logprobs = lp
    return actor.train_step(seqs)


def run(scenario: str, out: str, args: list[str]) -> None:
    import torch.distributed as dist

    from megatron_dapo.actor.actor import MegatronActor

    kv = dict(a.split("=", 1) for a in args)
    load = kv.pop("load", None)
    save = kv.pop("save", None)
    group = int(kv.pop("group", 1))
    cfg = make_cfg(**kv)
    actor = MegatronActor(cfg)
    extra = actor.load(load) if load else None
    seqs = make_seqs(group=group)
    result = {}
    if load:
        result["extra"] = extra
    if scenario == "init":
        actor.save(save)
        result["logprobs"] = actor.compute_logprobs(seqs)
    elif scenario == "logprobs":
        result["logprobs"], result["entropy"] = actor.compute_logprobs(seqs, with_entropy=True)
    elif scenario == "train":
        result["metrics"] = train_once(actor, seqs)
        result["params"] = full_params(actor)
        result["logprobs"] = actor.compute_logprobs(seqs)
        if save:
            actor.save(save, extra={"cursor": 7})
    elif scenario == "train_reuse":  # no old logprobs given: the first mini-batch takes them from its forward
        result["metrics"] = actor.train_step(seqs)
        result["old_logprobs"] = [s.old_logprobs for s in seqs]
        result["entropy"] = [s.entropy for s in seqs]
        result["params"] = full_params(actor)
    elif scenario in ("continue", "two_steps"):  # two_steps: step, save, step; continue: (load) step
        if scenario == "two_steps":
            train_once(actor, seqs)
            actor.save(save, extra={"cursor": 7})
        result["metrics"] = train_once(actor, seqs)
        result["logprobs"] = actor.compute_logprobs(seqs)
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.barrier()


def main():
    if sys.argv[1] == "--batch":
        with open(sys.argv[2]) as f:
            plan = json.load(f)
        for scenario, out, args in plan:
            run(scenario, out, args)
            gc.collect()  # the previous actor's model and optimizer
    else:
        run(sys.argv[1], sys.argv[2], sys.argv[3:])


if __name__ == "__main__":
    main()
