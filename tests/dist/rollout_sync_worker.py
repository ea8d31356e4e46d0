"""TP=2 actor → verified sync into the HF engine on rank 0 (`torchrun --nproc-per-node 2 ... OUT HF_DIR`)."""

import sys

import torch
import torch.distributed as dist


def hf_logprob_gap(hf_dir: str, seqs, actor_lp, plant: bool = False) -> float:
    """Max |logp_HF - logp_actor| over response tokens, with transformers loading the exported checkpoint; ``plant``
    swaps two query heads of layer 0 first (what a wrong QKV mapping would do) to show the comparison catches it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    if plant:
        q = model.model.layers[0].self_attn.q_proj
        d = model.config.hidden_size // model.config.num_attention_heads
        with torch.no_grad():
            for t in (q.weight, q.bias):
                t[: 2 * d] = torch.cat([t[d : 2 * d], t[:d]]).clone()
    gap = 0.0
    with torch.no_grad():
        for s, ref in zip(seqs, actor_lp):
            logits = model(s.tokens[None]).logits[0, s.prompt_len - 1 : -1].float()
            lp = logits.log_softmax(-1).gather(-1, s.tokens[s.prompt_len :, None])[:, 0]
            gap = max(gap, float((lp - ref).abs().max()))
    return gap


def main(out: str, hf_dir: str) -> None:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.types import Sequence
    from megatron_dapo.bridge.export import export_hf_tensors, save_hf_checkpoint
    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.loop.control import broadcast
    from megatron_dapo.types import SamplingParams, TokenizerInfo
    from megatron_dapo.engines.hf import HFEngine
    from megatron_dapo.sync.weight_sync import CopySync

    cfg = load_config("demo_cpu", ["parallel.tp=2", "train.batch_prompts=4", "train.mini_batch_prompts=2"])
    actor = MegatronActor(cfg)
    info = TokenizerInfo(eos_token_ids=(2,), pad_token_id=0)
    engine = HFEngine(actor.arch, info) if dist.get_rank() == 0 else None
    sync = CopySync(engine) if engine else None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 25, (n,), generator=g).tolist() for n in (5, 9, 7, 4)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)
    result = {}

    def sync_now(version):
        buckets = export_hf_tensors(actor.model, actor.arch)
        if sync:
            return sync.sync(buckets, version)
        for _ in buckets:
            pass

    sync_now(0)
    # 1) rollout logprobs of sampled tokens vs the actor's recomputed logprobs of the same sequences
    samples = broadcast(engine.generate(prompts, sampled, n=2) if engine else None)
    seqs = [
        Sequence(torch.tensor(s.prompt_ids + s.response_ids), len(s.prompt_ids), advantage=float(i % 2) - 0.5)
        for i, s in enumerate(samples)
    ]
    actor_lp = actor.compute_logprobs(seqs)
    gaps = torch.cat([(torch.tensor(s.logprobs) - a).abs() for s, a in zip(samples, actor_lp)])
    result["gap_mean"], result["gap_max"] = float(gaps.mean()), float(gaps.max())
    # 1b) at T = 0.7 both sides are of softmax(logits / T): the actor (vocab-parallel, TP = 2) equals the engine
    hot = SamplingParams(temperature=0.7, max_new_tokens=10, seed=4)
    hot_samples = broadcast(engine.generate(prompts, hot, n=2) if engine else None)
    hot_seqs = [Sequence(torch.tensor(s.prompt_ids + s.response_ids), len(s.prompt_ids)) for s in hot_samples]
    actor.temperature = 0.7
    hot_lp = actor.compute_logprobs(hot_seqs)
    actor.temperature = 1.0
    untempered = actor.compute_logprobs(hot_seqs)
    result["hot_gap"] = max(float((torch.tensor(s.logprobs) - a).abs().max()) for s, a in zip(hot_samples, hot_lp))
    result["hot_vs_t1"] = max(
        float((torch.tensor(s.logprobs) - a).abs().max()) for s, a in zip(hot_samples, untempered)
    )
    # 2) a train step, a sync, and the engine vs a fresh engine loaded from the exported HF checkpoint
    for s, lp in zip(seqs, actor_lp):
        s.old_logprobs = lp
    actor.train_step(seqs)
    trained_lp = actor.compute_logprobs(seqs)  # the megatron forward: the reference the export must reproduce
    sync_now(1)
    save_hf_checkpoint(actor.model, actor.arch, hf_dir)
    if engine:
        # 3) independent of our export code's consumers: transformers' own Qwen2 forward on the exported files
        result["hf_gap"] = hf_logprob_gap(hf_dir, seqs, trained_lp)
        result["hf_gap_planted"] = hf_logprob_gap(hf_dir, seqs, trained_lp, plant=True)
        fresh = HFEngine.from_pretrained(hf_dir, info)
        result["weights_equal"] = all(
            torch.equal(engine.state_tensor(n), fresh.state_tensor(n)) for n in engine.weight_names()
        )
        for name, params in (("greedy", greedy), ("sampled", sampled)):
            a, b = engine.generate(prompts, params, n=2), fresh.generate(prompts, params, n=2)
            result[f"{name}_equal"] = all(x.response_ids == y.response_ids for x, y in zip(a, b))
            result[f"{name}_lp_gap"] = max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x.logprobs, y.logprobs))
        torch.save(result, out)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
