"""Context-parallel slicing of a packed (THD) micro-batch, vendored so that it runs on every megatron-core in range.

Replaces ``megatron.core.utils.get_thd_batch_on_this_cp_rank`` of megatron-core 0.16.1 (``megatron/core/utils.py``
lines 2041-2078): build the THD ``PackedSeqParams`` and, with CP > 1, index-select EVERY array of the batch along the
sequence dimension with Transformer Engine's ``thd_get_partitioned_indices``. 0.19.2 dropped that function; its
replacement (``utils.py`` ``_get_batch_on_this_cp_rank_per_document_balancing``) slices only tokens, labels,
loss_mask and position_ids, which would leave our per-position arrays (advantages, old logprobs, ...) unsliced.

The partition index is computed here in torch, a transcription of TE's CUDA kernel
(``transformer_engine/common/fused_attn/context_parallel.cu``, ``thd_partition_indices_kernel`` and its
``binary_search``): one code path on CPU and GPU. ``tests/unit/test_thd_cp.py`` checks it against 0.16.1's function
(with a literal scalar transcription of the kernel as its ``tex``) on random inputs; ``tests/gpu/test_thd_cp_te.py``
against TE's own kernel where TE is importable.
"""

from __future__ import annotations

from typing import Any

import torch

# Keys that 0.16.1 leaves unsliced (utils.py:2074).
_NOT_PER_POSITION = frozenset({"attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen"})


def thd_partitioned_indices(cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int):
    """The positions of a packed row that CP rank ``cp_rank`` of ``cp_size`` keeps, as TE's kernel computes them:
    every sequence is cut into 2·cp_size equal chunks and rank r keeps chunks r and 2·cp_size−1−r (causal load
    balance). Each ``cu_seqlens_padded`` entry must be divisible by 2·cp_size (the kernel asserts it)."""
    cu = cu_seqlens_padded.to(torch.long).reshape(-1)
    if bool((cu % (2 * cp_size) != 0).any()):
        raise ValueError(
            f"cu_seqlens_padded = {cu.tolist()}: every entry must be divisible by 2*cp_size = {2 * cp_size}"
        )
    batch = cu.numel() - 1
    cu_s = cu // cp_size  # per-rank cumulative lengths (the kernel's shared cu_seqlens_s)
    token = torch.arange(total_tokens // cp_size, device=cu.device)
    # binary_search(token, cu_s, batch + 1): the last sequence whose start is <= token, searched in cu_s[1:batch]
    seq = torch.searchsorted(cu_s[1:batch].contiguous(), token, right=True)
    start = cu_s[seq]
    seq_len = cu_s[seq + 1] - start
    index = token - start
    offset = torch.where(index < seq_len // 2, cp_rank, (cp_size - 1) * 2 - cp_rank)
    return index + start * cp_size + seq_len // 2 * offset


def get_thd_batch_on_this_cp_rank(
    batch: dict[str, Any],
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    max_seqlen: torch.Tensor,
    cp_size: int | None = None,
    cp_rank: int | None = None,
):
    """(this CP rank's slice of ``batch``, THD ``PackedSeqParams``): the same values as megatron-core 0.16.1's
    function of this name; ``batch`` itself is left unchanged (0.16.1 rewrites it in place)."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    packed_seq_params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=int(max_seqlen[0].item()),
        max_seqlen_kv=int(max_seqlen[0].item()),
    )
    cp_size = parallel_state.get_context_parallel_world_size() if cp_size is None else cp_size
    cp_rank = parallel_state.get_context_parallel_rank() if cp_rank is None else cp_rank
    batch = dict(batch)
    if cp_size > 1:
        index = thd_partitioned_indices(cu_seqlens_padded, batch["tokens"].size(1), cp_size, cp_rank)
        for key, data in batch.items():
            if key not in _NOT_PER_POSITION:
                batch[key] = data.index_select(1, index)
    return batch, packed_seq_params
