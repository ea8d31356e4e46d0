"""DAPO overhead of MegatronActor.train_step vs a bare megatron-core forward+backward of the same tokens (one run).

    .venv/bin/python bench/bench_actor.py [--arch tiny] [--seqs 64] [--len 256]

Both sides use the same model chunks and the same packed micro-batches; the bare side calls megatron-core's
forward_backward_func with a plain token-mean NLL loss and the same optimizer update. The ratio (goal ≤ 1.10; the median
of ``--repeats`` interleaved pairs) is printed.
"""

import argparse
import time
import warnings

import torch

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="tiny")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.types import Sequence

    cfg = load_config(
        "demo_cpu",
        [
            f"model.arch={args.arch}",
            "train.batch_prompts=1",
            "train.mini_batch_prompts=1",
            f"parallel.max_tokens_per_micro_batch={4 * args.len}",
            f"rollout.sampling.max_new_tokens={args.len}",
        ],
    )
    actor = MegatronActor(cfg)
    g = torch.Generator().manual_seed(0)
    seqs = [
        Sequence(
            torch.randint(0, actor.arch.vocab_size, (args.len,), generator=g),
            prompt_len=args.len // 4,
            advantage=float(torch.randn(1, generator=g)),
        )
        for _ in range(args.seqs)
    ]
    for s, lp in zip(seqs, actor.compute_logprobs(seqs)):
        s.old_logprobs = lp
    mbs = actor._micro_batches(seqs)

    def bare_loss(mb, model, hidden):
        lp, _ = actor._token_logprobs(mb, model, hidden, with_entropy=False)
        loss = -lp.mean()
        return loss, {"loss": loss.detach()}

    def bare():  # the same micro-batches, forward+backward and the optimizer update; no DAPO loss or metrics
        for m in actor.model:
            m.zero_grad_buffer()
        actor.optimizer.zero_grad()
        actor._run(mbs, bare_loss, forward_only=False)
        actor._optimizer_update()

    def dapo():
        actor.train_step(seqs)

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    bare(), dapo()  # warm-up
    # interleaved pairs, so that drift in machine speed hits both sides alike; the median pair is reported
    pairs = sorted(((timed(bare), timed(dapo)) for _ in range(args.repeats)), key=lambda p: p[1] / p[0])
    t_bare, t_dapo = pairs[len(pairs) // 2]
    tokens = args.seqs * args.len
    print(f"tokens per step: {tokens}")
    print(f"bare megatron-core fwd+bwd+update: {tokens / t_bare:.0f} tok/s")
    print(f"MegatronActor.train_step:   {tokens / t_dapo:.0f} tok/s (incl. packing, loss, metrics, optimizer step)")
    ratio = t_dapo / t_bare
    spread = f"{pairs[0][1] / pairs[0][0]:.3f}-{pairs[-1][1] / pairs[-1][0]:.3f}"
    print(
        f"time ratio train_step / bare = {ratio:.3f}  (median of {len(pairs)} interleaved pairs, {spread}; "
        f"goal <= 1.10: {'PASS' if ratio <= 1.10 else 'FAIL'})"
    )


if __name__ == "__main__":
    main()
