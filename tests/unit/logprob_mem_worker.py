"""Peak RSS of one vocab-parallel logprob computation: ``python logprob_mem_worker.py SEQ_LEN CHUNK`` prints JSON."""

import json
import resource
import sys

import torch


def main(seq_len: int, chunk: int) -> None:
    from megatron_dapo.actor.dist import init_distributed
    from megatron_dapo.actor.logprobs import token_logprobs
    from megatron_dapo.config import ParallelConfig

    init_distributed(ParallelConfig())
    torch.manual_seed(0)
    vocab, hidden = 32768, 64
    weight = torch.randn(vocab, hidden) * 0.05
    h = torch.randn(seq_len, hidden)
    targets = torch.randint(0, vocab, (seq_len,))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lp, ent = token_logprobs(h, weight, targets, vocab, chunk_tokens=chunk, with_entropy=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"extra_mb": (peak - base) / 1024, "sum": float(lp.sum()), "ent": float(ent.sum())}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
