"""The shape of one micro-batch: which layout, and how much padding each kernel's rules require.

Two layouts, chosen by the attention implementation (``micro_batch_geometry``):

* ``thd`` (Transformer Engine, GPU): the sequences of a micro-batch are packed into one row of T tokens; TE's varlen
  attention keeps them apart through ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded`` (slot offsets). The
  cost of a micro-batch is T = Σ slot lengths, rounded up.
* ``padded`` (the local megatron-core spec: CPU, or GPU without TE): a [B, L] batch, each sequence right-padded to
  the longest one of its micro-batch, one shared causal mask. Dense attention costs B·L² instead of the (Σ lengths)²
  that a packed row with a block-diagonal mask would cost, and the [T, T] mask is never built. Micro-batches are
  length-bucketed (``pack_padded``) so that little is padded. The cost of a micro-batch is B·L.

THD padding rules, each satisfied here and cited (TE = TransformerEngine 2.19/2.20, MC = megatron-core 0.16.1):

1. Context parallel: every slot is a multiple of 2·CP, and the slots cover the whole row
   (TE common/fused_attn/context_parallel.cu:100-103 ``assert(seqlen % (world_size * 2) == 0)`` on every
   ``cu_seqlens_padded`` entry; :747 on the total). Extra tokens therefore go into the last slot, never after it.
2. Sequence parallel: the tokens of a CP rank, L = T/CP, divide by TP (MC tensor_parallel/mappings.py:171-174,
   the reduce-scatter of the embedding: "First dimension of the tensor should be divisible by tensor parallel size").
3. FP8: the flattened token dimension of every FP8 GEMM is a multiple of 8 (TE pytorch/utils.py:614-624
   ``assert_dim_for_fp8_exec``, called on the local input in module/linear.py:376, layernorm_linear.py:181-184,
   layernorm_mlp.py:354-356), and on Hopper the weight-gradient GEMM needs the gathered token count to be a
   multiple of 16 (TE common/gemm/cublaslt_gemm.cu:161-162, 251-253: "Leading dimension requirement ... FP8 GEMM").
   TE pads to 16 itself (pytorch/quantization.py:262-278 ``get_align_size_for_quantization``: 16; 32 for MXFP8).
   With SP the column-parallel GEMMs see L/TP tokens: we ask L % (16·TP) == 0 (the hard minimum is lcm(16, 8·TP)).
4. ``max_seqlen`` is the longest *padded* slot, global (not ÷ CP): TE divides it by CP itself
   (pytorch/attention/dot_product_attention/context_parallel.py:1446-1450) and megatron sizes the RoPE table from it
   (MC models/common/embeddings/rotary_pos_embedding.py:238-241), indexing each slot up to its padded length
   (MC models/common/embeddings/rope_utils.py:153-168). It must never equal T with more than one slot: RoPE then
   numbers positions across the whole row (rope_utils.py:211).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Layout = Literal["thd", "padded"]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple if multiple > 1 else n


@dataclass(frozen=True)
class Geometry:
    layout: Layout
    slot_multiple: int = 1  # every THD slot is a multiple of this (rule 1)
    total_multiple: int = 1  # the packed row T is a multiple of this (rules 1-3)

    def cost(self, lengths: Sequence[int]) -> int:
        """Tokens the micro-batch of these sequences occupies (what the token budget bounds)."""
        if not lengths:
            return self.dummy_tokens
        if self.layout == "padded":
            return len(lengths) * max(lengths)
        return round_up(sum(round_up(n, self.slot_multiple) for n in lengths), self.total_multiple)

    @property
    def dummy_tokens(self) -> int:
        """Length of the one-sequence dummy an empty micro-batch runs (it must satisfy the rules too)."""
        return max(self.total_multiple, self.slot_multiple, 1)

    def slots(self, lengths: Sequence[int]) -> tuple[list[int], int, int]:
        """THD: (slot lengths, total T, max_seqlen) for sequences of ``lengths`` (see the module docstring)."""
        if not lengths or min(lengths) < 1:
            raise ValueError(f"lengths = {list(lengths)}: a packed micro-batch needs sequences of >= 1 token")
        slots = [round_up(n, self.slot_multiple) for n in lengths]
        total = round_up(sum(slots), self.total_multiple)
        slots[-1] += total - sum(slots)  # rule 1: the extra stays inside the last slot
        max_seqlen = max(slots)  # rule 4
        assert len(slots) == 1 or max_seqlen < total
        return slots, total, max_seqlen


def micro_batch_geometry(
    te: bool, *, tp: int = 1, cp: int = 1, sequence_parallel: bool = False, fp8: bool = False, fp8_align: int = 16
) -> Geometry:
    """The layout and padding multiples for this parallel / precision setting (rules in the module docstring)."""
    if not te:
        if cp > 1 or sequence_parallel or fp8:
            raise ValueError("context parallel, sequence parallel and FP8 need the Transformer Engine (thd) layout")
        return Geometry("padded")
    slot = 2 * cp if cp > 1 else 1  # rule 1
    per_rank = 1  # multiple of L = T / CP
    if sequence_parallel:
        per_rank = math.lcm(per_rank, tp)  # rule 2
    if fp8:
        per_rank = math.lcm(per_rank, fp8_align * (tp if sequence_parallel else 1))  # rule 3
    return Geometry("thd", slot_multiple=slot, total_multiple=math.lcm(slot, cp * per_rank))
