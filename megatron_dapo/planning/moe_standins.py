"""What the rehearsal's step (``planning/rank_step.py``) puts in place of the data-dependent part of megatron-core's
MoE token dispatch, so a mixture of experts trains on fake tensors with the shapes a real routing gives.

On fake tensors the router runs as on a GPU (its gating GEMM, top-k, the scatter into ``routing_map``, the aux loss),
but how many tokens each expert gets is data: the alltoall dispatcher counts them (``routing_map.sum``) and reads the
counts as Python sizes for its all-to-all, its all-gather over TP and its per-expert splits, and ``permute`` picks the
routed copies with ``masked_select``, whose output shape the fake mode refuses (it has no data to count). A fake
tensor read as a list reads 1s in the rehearsal world (``rank_step._ones_list``), which would give each expert one
token. Two functions of megatron-core 0.16.1 are wrapped, nothing else of the MoE layer; the router, the experts'
GEMMs (``SequentialMLP``), the all-to-all and all-gather over the fake group, the sort by local expert, the reduce-
scatter of the combine and ``unpermute`` stay megatron-core's own code:

| megatron-core 0.16.1 | what is data | stand-in |
|---|---|---|
| ``transformer/moe/token_dispatcher.py:469-590`` ``MoEAlltoAllTokenDispatcher.preprocess`` | the counts per expert (:511), their splits per EP rank and TP rank (:531-560), read as sizes at :695, :778 (``tolist``), by ``sort_chunks_by_idxs`` (moe_utils.py:505-509) and ``SequentialMLP.forward`` (experts.py:910) | megatron-core's ``preprocess`` runs (its count all-gather over TP × EP included), then the counts it set are replaced by ``balanced_counts`` as real CPU tensors |
| ``transformer/moe/moe_utils.py:289-377`` ``permute`` (imported by token_dispatcher.py:33, called at :637) | ``masked_select`` (:369, :372): the routed copies in expert order | the same ops with ``masked_select`` replaced by ``_MaskedSelect``: ``num_out_tokens`` elements, saving for backward what torch's ``MaskedSelectBackward0`` saves (the mask and the input) |

The counts (``balanced_counts``): dropless routing sends each of a rank's ``tokens`` to ``topk`` experts, so the rank
permutes exactly ``tokens × topk`` copies (token_dispatcher.py:524, ``num_out_tokens``), spread evenly over the
experts. What an expert-parallel rank *receives* is data: the rehearsed rank is the busiest one, receiving from every
EP peer its balanced share × ``imbalance`` (``PlanOptions.moe_imbalance``, the planner's assumption: the busiest EP
rank's routed tokens over the mean). With EP = 1 every rank holds all the experts and receives exactly the
``tokens × topk`` copies of each TP peer (the all-to-all is the identity: tensor_parallel/mappings.py:430), whatever
the routing: no imbalance is possible.

Not replaced: the aux loss (``moe_aux_loss_coeff``; router.py:275-313, moe_utils.py:46-133 and :214-234) is tensor
arithmetic on the counts (a sum, an all-reduce over TP × CP, a product with the probabilities), no sizes read from
data: it runs as is, and its logged value (``train/moe_load_balancing_loss``) reads 1 like any fake number. Routing
replay: the step keeps the recipe's (``rank_step.step_config``); the samples carry routes that spread the tokens evenly
(``rank_step.balanced_routes``) and the routers replay them (router_replay.py:116-161, a gather of the given indices)
in every forward and, under full recompute, in the recomputed one. The routing map is a fake tensor either way, so the
counts are this module's either way.

Also replaced, in ``preprocess``: the dispatcher's chunk orders ``sort_input_by_local_experts`` and
``restore_output_by_local_experts`` (token_dispatcher.py:405-416), index tensors megatron-core builds with
``torch.arange`` in ``__init__``, which the step's build runs under its fake mode: the same values, as real tensors
(``sort_chunks_by_idxs`` reads them with ``tolist``, moe_utils.py:506).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from megatron_dapo.planning.plans import PlanOptions

IMBALANCE = PlanOptions.moe_imbalance


def _even(total: int, parts: int) -> torch.Tensor:
    """``total`` split into ``parts`` integers as equal as they come (the first ones one larger), summing to it."""
    base, extra = divmod(total, parts)
    return torch.tensor([base + (i < extra) for i in range(parts)], dtype=torch.long)


@dataclass
class Counts:
    """The dispatcher's token counts of one MoE layer on one rank (token_dispatcher.py:469-590, same names)."""

    local_per_expert: torch.Tensor  # [experts]: this rank's routed copies per expert (:511)
    input_splits: torch.Tensor  # [ep]: copies sent to each EP rank (:531)
    output_splits: torch.Tensor  # [ep]: copies received from each EP rank, this TP rank's share (:554)
    output_splits_tp: torch.Tensor  # [tp]: copies received from each TP rank of the group (:558)
    global_per_local_expert: torch.Tensor  # [tp, ep, local experts]: every source's copies per local expert (:546)

    @property
    def per_local_expert(self) -> torch.Tensor:
        """[local experts]: what each of this rank's experts runs on (:560, the ``tokens_per_expert`` returned)."""
        return self.global_per_local_expert.sum(dim=(0, 1))


def balanced_counts(
    tokens: int, topk: int, experts: int, tp: int, ep: int, tp_rank: int = 0, imbalance: float = IMBALANCE
) -> Counts:
    """The counts of a balanced dropless routing of ``tokens`` (this rank's sequence-parallel shard) to ``topk`` of
    ``experts`` each, on the busiest EP rank (module docstring): it sends its copies evenly to every EP rank and
    receives from each EP peer, of each TP rank of its group, ``tokens × topk / EP × imbalance`` (EP > 1) or all
    ``tokens × topk`` (EP = 1), spread evenly over its local experts."""
    routed = tokens * topk
    local_experts = experts // ep
    local = _even(routed, experts)
    received = round(routed / ep * imbalance) if ep > 1 else routed  # from one source (a TP rank × EP rank)
    per_source = _even(received, local_experts)
    glob = per_source.expand(tp, ep, local_experts).contiguous()
    return Counts(
        local_per_expert=local,
        input_splits=local.reshape(ep, local_experts).sum(dim=1),
        output_splits=glob[tp_rank].sum(dim=1),
        output_splits_tp=glob.sum(dim=(1, 2)),
        global_per_local_expert=glob,
    )


class _MaskedSelect(torch.autograd.Function):
    """``x.masked_select(mask)`` with ``count`` elements: the output torch's kernel would give a mask with ``count``
    True, and the backward's memory (torch saves the mask and the input; the gradient is the input's shape)."""

    @staticmethod
    def forward(ctx, x, mask, count: int):
        ctx.save_for_backward(x, mask)
        return mask.new_empty((count,), dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, _mask = ctx.saved_tensors
        return grad.new_zeros(x.shape), None, None


def _masked_select(x: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
    """(the mask is fake: so is the result, as torch's would be where a fake operand meets a real one)"""
    if x.requires_grad:
        return _MaskedSelect.apply(x, mask, count)
    return mask.new_empty((count,), dtype=x.dtype)


def _is_fake(t) -> bool:
    return isinstance(t, FakeTensor)


def _counts_of(dispatcher, routing_map) -> Counts:
    return balanced_counts(
        routing_map.size(0),
        dispatcher.config.moe_router_topk,
        dispatcher.num_experts,
        dispatcher.tp_size,
        dispatcher.ep_size,
        dispatcher.tp_rank,
    )


@contextlib.contextmanager
def moe_stand_ins() -> Iterator[None]:
    """Within: megatron-core's alltoall dispatcher counts and permutes a fake ``routing_map`` as a balanced routing
    does (module docstring); real tensors take megatron-core's own path. Undone at the end."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    Dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    real_preprocess, real_permute = Dispatcher.preprocess, token_dispatcher.permute

    def preprocess(self, routing_map):
        out = real_preprocess(self, routing_map)  # megatron-core's: the counts' ops and all-gather on fake tensors
        if not _is_fake(routing_map) or self.drop_and_pad:
            return out
        with unset_fake_temporarily():  # real CPU tensors: their values are read as sizes
            c = _counts_of(self, routing_map)
            local = self.num_local_experts
            if self.ep_size > 1 or self.tp_size > 1:  # token_dispatcher.py:531-560
                self.input_splits, self.output_splits = c.input_splits, c.output_splits
                self.output_splits_tp = c.output_splits_tp
            if local > 1:  # token_dispatcher.py:575-580
                self.num_global_tokens_per_local_expert = c.global_per_local_expert.view(-1, local)
                chunks = torch.arange(self.num_experts * self.tp_size)  # token_dispatcher.py:405-416
                self.sort_input_by_local_experts = chunks.reshape(-1, local).T.ravel()
                self.restore_output_by_local_experts = chunks.reshape(local, -1).T.ravel()
            return c.per_local_expert

    def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False):
        if fused or drop_and_pad or not _is_fake(routing_map):
            return real_permute(tokens, routing_map, probs, num_out_tokens, fused, drop_and_pad)
        # moe_utils.py:355-377 as it runs, masked_select's count given: dropless, num_out_tokens = tokens × topk
        num_tokens, _hidden = tokens.shape
        num_experts = routing_map.shape[1]
        count = int(num_out_tokens) if num_out_tokens is not None else num_tokens
        routing_map = routing_map.bool().T.contiguous()
        token_indices = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)
        sorted_indices = _masked_select(token_indices, routing_map, count)
        permuted_probs = None
        if probs is not None:
            permuted_probs = _masked_select(probs.T.contiguous(), routing_map, count)
        permuted_input = tokens.index_select(0, sorted_indices)
        return permuted_input, permuted_probs, sorted_indices

    Dispatcher.preprocess, token_dispatcher.permute = preprocess, permute
    try:
        yield
    finally:
        Dispatcher.preprocess, token_dispatcher.permute = real_preprocess, real_permute
        assert moe_utils.permute is real_permute
