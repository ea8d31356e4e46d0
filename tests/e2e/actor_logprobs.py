"""Reference logprobs from a megatron-dapo checkpoint: ``python actor_logprobs.py RUN_CONFIG CKPT OUT``.

Builds a one-process actor (TP = PP = 1, whatever the checkpoint was saved with), loads the checkpoint and computes
the logprobs of a few fixed random sequences; saves {"tokens", "prompt_lens", "logprobs"} to OUT."""

import sys

import torch


def main(config: str, ckpt: str, out: str) -> None:
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.types import Sequence

    cfg = load_config(config, ["parallel.tp=1", "parallel.pp=1"])
    actor = MegatronActor(cfg)
    actor.load(ckpt, load_optimizer=False)
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(torch.randint(1, actor.arch.vocab_size, (n,), generator=g), prompt_len=p)
            for n, p in ((12, 5), (9, 3), (16, 8), (7, 6))]  # fmt: skip
    lps = actor.compute_logprobs(seqs)
    torch.save({"tokens": [s.tokens for s in seqs], "prompt_lens": [s.prompt_len for s in seqs], "logprobs": lps}, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
