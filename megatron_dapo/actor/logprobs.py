"""Memory-bounded, vocab-parallel log-probabilities and entropy of target tokens.

Each TP rank holds the output weight shard ``[V/TP, h]``. Logits are formed ``chunk_tokens`` at a time and reduced
across TP (megatron-core's ``vocab_parallel_cross_entropy``), so the full vocabulary is never gathered and the extra
memory is O(chunk × V/TP), independent of the sequence length. With gradients, each chunk is recomputed in backward
(activation checkpointing), so the saved softmax of one chunk is all that lives at a time.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _vocab_range(weight_rows: int, real_vocab: int) -> tuple[int, int]:
    from megatron.core import parallel_state

    start = parallel_state.get_tensor_model_parallel_rank() * weight_rows
    return start, max(0, min(weight_rows, real_vocab - start))


def _masked_logits(hidden: torch.Tensor, weight: torch.Tensor, real_vocab: int, temperature: float) -> torch.Tensor:
    """``hidden [n, h] @ weight[V/TP, h]^T / T`` in fp32, the padded vocabulary entries set to the dtype minimum."""
    logits = torch.matmul(hidden, weight.t()).float()
    if temperature != 1.0:
        logits = logits / temperature
    _, valid = _vocab_range(weight.shape[0], real_vocab)
    if valid < weight.shape[0]:
        logits = logits.clone()
        logits[:, valid:] = torch.finfo(logits.dtype).min
    return logits


def _chunk_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, real_vocab: int, temperature: float
) -> torch.Tensor:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = _masked_logits(hidden, weight, real_vocab, temperature)
    # vocab_parallel_cross_entropy expects [s, b, V/TP] and returns -log p(target) [s, b].
    return -vocab_parallel_cross_entropy(logits.unsqueeze(1), targets.unsqueeze(1)).squeeze(1)


@torch.no_grad()
def _chunk_entropy(hidden: torch.Tensor, weight: torch.Tensor, real_vocab: int, temperature: float) -> torch.Tensor:
    import torch.distributed as dist

    logits = _masked_logits(hidden, weight, real_vocab, temperature)
    group = _tp_group()
    logits_max = logits.max(dim=-1).values
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - logits_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = exp.sum(-1)
    sum_exp_logit = (exp * shifted).sum(-1)
    dist.all_reduce(sum_exp, group=group)
    dist.all_reduce(sum_exp_logit, group=group)
    # H = log Z - E_p[logit]  (logits shifted by their max)
    return sum_exp.log() - sum_exp_logit / sum_exp


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    real_vocab: int,
    *,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
    grad_reduced: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) for ``hidden [n, h]`` rows under the vocab-parallel head ``weight [V/TP, h]``, of the
    distribution softmax(logits / ``temperature``) (the one a rollout at that temperature samples from).

    Returns ``(logprobs [n] fp32, entropy [n] fp32 or None)``. Differentiable w.r.t. ``hidden`` and ``weight`` when
    grad is enabled; the hidden state's gradient is all-reduced across TP like megatron's ColumnParallelLinear input,
    unless ``grad_reduced``: the caller's sequence-parallel gather already reduce-scatters it in backward.
    """
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    if hidden.requires_grad and not grad_reduced:
        hidden = copy_to_tensor_model_parallel_region(hidden)
    outs, ents = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start : start + chunk_tokens]
        t = targets[start : start + chunk_tokens]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            outs.append(checkpoint(_chunk_logprobs, h, weight, t, real_vocab, temperature, use_reentrant=False))
        else:
            outs.append(_chunk_logprobs(h, weight, t, real_vocab, temperature))
        if with_entropy:
            ents.append(_chunk_entropy(h.detach(), weight.detach(), real_vocab, temperature))
    # no positions (an empty micro-batch): an empty result still connected to the graph, so backward runs
    logprobs = torch.cat(outs) if outs else hidden[:0, 0].float() * 0
    entropy = (torch.cat(ents) if ents else hidden.new_zeros(0, dtype=torch.float32)) if with_entropy else None
    return logprobs, entropy
