"""GPU actor scenarios, run under torchrun by tests/gpu/test_actor_gpu.py (NCCL, one process per GPU)."""

import json
import sys

import torch
import torch.distributed as dist


def seqs_for(n, min_len, max_len, vocab, seed=0):
    from megatron_dapo.types import Sequence

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len, (1,), generator=g))
        out.append(
            Sequence(
                torch.randint(0, vocab, (length,), generator=g),
                prompt_len=max(2, length // 8),
                advantage=float(torch.randn(1, generator=g)),
            )
        )
    return out


def _step(actor, seqs) -> dict:
    """Logprobs before, one DAPO step (π_old recomputed), logprobs after: what the CPU and GPU runs compare."""
    before = actor.compute_logprobs(seqs)
    for s, lp in zip(seqs, before):
        s.old_logprobs = lp
    metrics = actor.train_step(seqs)
    after = actor.compute_logprobs(seqs)
    return {"before": [lp.tolist() for lp in before], "after": [lp.tolist() for lp in after],
            "loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"]}  # fmt: skip


def _cuda_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def main(scenario: str, out: str, *overrides: str) -> None:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.config.run_config import load_config

    kv = [o for o in overrides if not o.startswith(("save=", "load="))]
    paths = dict(o.split("=", 1) for o in overrides if o.startswith(("save=", "load=")))
    cfg = load_config(
        "demo_cpu",
        [
            "rollout.sampling.max_new_tokens=24000",
            "data.max_prompt_len=16",
            "parallel.max_tokens_per_micro_batch=24016",
            *kv,
        ],
    )
    actor = MegatronActor(cfg)
    if "load" in paths:
        actor.load(paths["load"], load_optimizer=False)
    result = {"te": actor.te, "device": str(actor.device)}
    if scenario == "logprobs":  # CP / THD comparisons: same weights (seeded init), same sequences
        seqs = seqs_for(6, 16, 300, actor.arch.vocab_size)
        result["logprobs"] = [lp.tolist() for lp in actor.compute_logprobs(seqs)]
    elif scenario == "train":  # TE spec (+ FP8 when asked): one DAPO step runs and changes the policy
        seqs = seqs_for(8, 64, 512, actor.arch.vocab_size)
        for s, lp in zip(seqs, actor.compute_logprobs(seqs)):
            s.old_logprobs = lp
        result["metrics"] = actor.train_step(seqs)
    elif scenario == "step":  # CPU reference (save= its initial weights) or the GPU run from them (load=)
        if "save" in paths:
            actor.save(paths["save"])
        result.update(_step(actor, seqs_for(6, 32, 256, actor.arch.vocab_size)))
    elif scenario == "offload":  # grads + Adam states to the host and back: freed, then the same next step
        from megatron_dapo.loop.phases import offload_train_state, reload_train_state

        seqs = seqs_for(6, 32, 256, actor.arch.vocab_size)
        _step(actor, seqs)  # Adam allocates its states
        params = sum(p.numel() for m in actor.model for p in m.module.parameters())
        held = _cuda_bytes()
        offload_train_state(actor)
        offloaded = _cuda_bytes()
        reload_train_state(actor)
        result.update(params=params, held=held, offloaded=offloaded, reloaded=_cuda_bytes())
        result["second"] = _step(actor, seqs_for(6, 32, 256, actor.arch.vocab_size, seed=1))
    elif scenario == "two_steps":  # the reference for "offload": the same two steps, nothing offloaded
        _step(actor, seqs_for(6, 32, 256, actor.arch.vocab_size))
        result["second"] = _step(actor, seqs_for(6, 32, 256, actor.arch.vocab_size, seed=1))
    elif scenario == "long":  # one ~20k-token packed micro-batch: measured vs predicted memory
        torch.cuda.reset_peak_memory_stats()
        seqs = seqs_for(2, 9000, 11000, actor.arch.vocab_size)
        for s, lp in zip(seqs, actor.compute_logprobs(seqs)):
            s.old_logprobs = lp
        actor.train_step(seqs)
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["tokens"] = sum(int(s.tokens.numel()) for s in seqs)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:])
