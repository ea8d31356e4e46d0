"""Sequence-parallel logits head on TP = 2 (gloo): ``torchrun --nproc-per-node 2 sp_head_worker.py OUT``.

Each rank holds half of the sequence ([s/2, 1, h], as megatron's sequence parallelism leaves the last layer's output)
and half of the vocabulary. The actor's head gathers the sequence (megatron's output-layer gather) and computes
vocab-parallel logprobs; the reference is a plain single-process log-softmax over the full tensors. Saves, for
rank 0, logprobs and gradients of both paths, and of the planted fault (the gather plus a second TP all-reduce)."""

import sys

import torch
import torch.distributed as dist


def main(out: str) -> None:
    from megatron_dapo.actor.actor import _sequence_parallel_head
    from megatron_dapo.actor.dist import init_distributed
    from megatron_dapo.actor.logprobs import token_logprobs
    from megatron_dapo.config.run_config import ParallelConfig

    init_distributed(ParallelConfig(tp=2))
    rank, s, h, vocab = dist.get_rank(), 8, 16, 48
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(s, 1, h, generator=g), torch.randn(vocab, h, generator=g)
    targets = torch.randint(0, 40, (s,), generator=g)  # the last 8 vocabulary rows are padding

    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = (ref_h[:, 0] @ ref_w.t())[:, :40] / 0.7
    ref_lp = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    (ref_lp * torch.arange(1.0, s + 1)).sum().backward()

    result = {"ref_lp": ref_lp.detach(), "ref_h": ref_h.grad, "ref_w": ref_w.grad}
    for name, grad_reduced in (("sp", True), ("planted", False)):
        local_h = hidden[rank * s // 2 : (rank + 1) * s // 2].clone().requires_grad_()
        local_w = weight[rank * vocab // 2 : (rank + 1) * vocab // 2].clone().requires_grad_()
        full, _ = _sequence_parallel_head(local_h)
        lp, _ = token_logprobs(full[:, 0], local_w, targets, 40, chunk_tokens=3, grad_reduced=grad_reduced,
                               temperature=0.7)  # fmt: skip
        (lp * torch.arange(1.0, s + 1)).sum().backward()
        grads_h, grads_w = [torch.zeros_like(local_h) for _ in range(2)], [torch.zeros_like(local_w) for _ in range(2)]
        dist.all_gather(grads_h, local_h.grad)
        dist.all_gather(grads_w, local_w.grad)
        result[name] = {"lp": lp.detach(), "h": torch.cat(grads_h), "w": torch.cat(grads_w)}
    if rank == 0:
        torch.save(result, out)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
