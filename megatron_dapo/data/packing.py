"""Token-budget micro-batches of variable-length sequences, balanced across data-parallel ranks.

A micro-batch's shape follows its ``Geometry`` (``data/geometry.py``): on Transformer Engine the sequences are
*packed* into one row (the THD layout, ``pack_sequences``), on the local spec they form length-bucketed, right-padded
[B, L] rows (``pack_padded`` over the rows of ``data/shared_prompt.py``). Either way the token budget bounds ``geometry.cost`` of each micro-batch: Σ slot
lengths rounded up (THD), or B·L (padded).

Padding waste, precisely (``padding_waste``)::

    padded_tokens = Σ over micro-batches of geometry.cost(lengths in it)   (an empty micro-batch counts as the dummy
                                                                             the actor runs: geometry.dummy_tokens)
    waste         = padded_tokens / real_tokens − 1

The pad-to-longest baseline (``pad_to_longest_waste``) pads every micro-batch of k sequences to k × its longest.

Empty micro-batches. ``balance_across_dp`` gives every DP rank the SAME number of micro-batches so that the
collectives of the pipeline schedule and of the gradient reduction are entered equally often on every rank and never
deadlock. A rank with less data first splits its multi-sequence micro-batches; only when none can be split does it get
an empty one (``[]``). The actor must still run an empty micro-batch: a dummy sequence of pad tokens with no valid
position, so its forward/backward contributes exactly zero loss and zero gradient, and the global token count used as
the loss denominator is unchanged.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_dapo.data.geometry import Geometry, round_up

__all__ = [
    "BalanceStats",
    "PackedSequences",
    "balance_across_dp",
    "pack_by_token_budget",
    "pack_padded",
    "pack_sequences",
    "pad_to_longest_waste",
    "padding_waste",
    "partition_karmarkar_karp",
    "round_up",
    "split_mini_batches",
]


def _check_lengths(lengths: Sequence[int], max_tokens: int | None = None) -> None:
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens = {max_tokens}: must be >= 1")
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"lengths[{i}] = {n!r}: must be a non-negative integer")
        if max_tokens is not None and n > max_tokens:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than the micro-batch budget max_tokens = {max_tokens} "
                "(raise parallel.max_tokens_per_micro_batch or shorten the sequence)"
            )


# ----------------------------------------------------------------------------------------------------------------------
# Bin packing


def pack_by_token_budget(
    lengths: Sequence[int], max_tokens: int, indices: Sequence[int] | None = None
) -> list[list[int]]:
    """Group sequence indices into micro-batches whose token sums are ≤ ``max_tokens``.

    Best-fit decreasing: sequences are taken longest first (ties by index) and each goes into the open micro-batch
    with the least room that still fits it, else into a new one. BFD uses at most 11/9·OPT + 6/9 bins and is
    deterministic. ``indices`` (default ``range(len(lengths))``) selects which sequences to pack; the returned lists
    hold those indices, each exactly once, each list sorted ascending; micro-batches are ordered by their first
    (longest) sequence.
    """
    _check_lengths(lengths, max_tokens)
    order = sorted(range(len(lengths)) if indices is None else indices, key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    # Open bins sorted by (room, bin id): bisect finds the tightest bin with room >= length.
    rooms: list[tuple[int, int]] = []
    for i in order:
        n = lengths[i]
        pos = bisect.bisect_left(rooms, (n, -1))
        if pos < len(rooms):
            room, b = rooms.pop(pos)
        else:
            room, b = max_tokens, len(bins)
            bins.append([])
        bins[b].append(i)
        bisect.insort(rooms, (room - n, b))
    return [sorted(b) for b in bins]


def pack_padded(lengths: Sequence[int], max_tokens: int, indices: Sequence[int] | None = None) -> list[list[int]]:
    """Length-bucketed micro-batches for the padded [B, L] layout: B·L ≤ ``max_tokens``.

    Sequences are taken longest first (ties by index); a micro-batch grows while (its size + 1) × its first (longest)
    length fits the budget, so each holds sequences of similar length and pads little. Deterministic; each returned
    list is sorted ascending; micro-batches are ordered by their longest sequence.
    """
    _check_lengths(lengths, max_tokens)
    order = sorted(range(len(lengths)) if indices is None else indices, key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    for i in order:
        if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= max_tokens:
            bins[-1].append(i)
        else:
            bins.append([i])
    return [sorted(b) for b in bins]


# ----------------------------------------------------------------------------------------------------------------------
# Balancing over data-parallel ranks


def _flatten(tree) -> list[int]:
    """Items of a Karmarkar–Karp subset, stored as nested pairs to make merging O(1)."""
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if isinstance(node, int):
            out.append(node)
        else:
            stack.extend(node)
    return out


def partition_karmarkar_karp(lengths: Sequence[int], parts: int, refine_rounds: int = 64) -> list[list[int]]:
    """Split indices into ``parts`` subsets with near-equal length sums.

    Multiway Karmarkar–Karp (largest differencing method): every item starts as a k-tuple of subsets
    (itself, ∅, …, ∅); repeatedly the two tuples with the largest spread (max − min sum) are merged by pairing the
    heaviest subset of one with the lightest of the other, which cancels their differences. Then a refinement:
    up to ``refine_rounds`` times, the single move or pairwise swap between the heaviest and the lightest subset that
    most reduces their gap is applied (stops when none helps). Deterministic (ties broken by index).
    Returns lists of indices, each sorted ascending.
    """
    if parts < 1:
        raise ValueError(f"parts = {parts}: must be >= 1")
    _check_lengths(lengths)
    counter = itertools.count()
    heap: list = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        subsets = [(lengths[i], i)] + [(0, None)] * (parts - 1)
        heapq.heappush(heap, (-lengths[i], next(counter), subsets))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)  # both sorted heaviest first
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, (ta, tb)) for (sa, ta), (sb, tb) in zip(a, reversed(b))]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(counter), merged))
    subsets = [sorted(_flatten(t)) for _, t in heap[0][2]] if heap else [[] for _ in range(parts)]
    _refine(lengths, subsets, refine_rounds)
    return subsets


def _refine(lengths: Sequence[int], subsets: list[list[int]], rounds: int) -> None:
    """Greedy move/swap between the heaviest and lightest subset while it shrinks their gap (in place)."""
    for _ in range(rounds):
        loads = [sum(lengths[i] for i in s) for s in subsets]
        hi = max(range(len(subsets)), key=lambda k: (loads[k], -k))
        lo = min(range(len(subsets)), key=lambda k: (loads[k], k))
        gap = loads[hi] - loads[lo]
        if gap <= 1:
            return
        # Moving/swapping a net amount d from hi to lo leaves a gap |gap - 2d|; we want d close to gap/2, 0 < d < gap.
        best = (gap, None, None)  # (new gap, item from hi, item from lo or None)
        lo_sorted = sorted(subsets[lo], key=lambda i: (lengths[i], i))
        lo_lens = [lengths[i] for i in lo_sorted]
        for a in subsets[hi]:
            la = lengths[a]
            if 0 < la < gap and abs(gap - 2 * la) < best[0]:
                best = (abs(gap - 2 * la), a, None)
            # swap a for b: d = la - lb, want lb ≈ la - gap/2
            pos = bisect.bisect_left(lo_lens, la - gap / 2)
            for p in (pos - 1, pos):
                if 0 <= p < len(lo_lens) and 0 < la - lo_lens[p] < gap and abs(gap - 2 * (la - lo_lens[p])) < best[0]:
                    best = (abs(gap - 2 * (la - lo_lens[p])), a, lo_sorted[p])
        if best[1] is None:
            return
        _, a, b = best
        subsets[hi].remove(a)
        subsets[lo].append(a)
        if b is not None:
            subsets[lo].remove(b)
            subsets[hi].append(b)
        subsets[hi].sort()
        subsets[lo].sort()


def _split_in_two(lengths: Sequence[int], mb: list[int]) -> tuple[list[int], list[int]]:
    """Split a micro-batch of ≥ 2 sequences into two with near-equal token sums (greedy, longest first)."""
    a: list[int] = []
    b: list[int] = []
    sa = sb = 0
    for i in sorted(mb, key=lambda j: (-lengths[j], j)):
        if sa <= sb:
            a.append(i)
            sa += lengths[i]
        else:
            b.append(i)
            sb += lengths[i]
    return sorted(a), sorted(b)


def _split_padded(lengths: Sequence[int], mb: list[int]) -> tuple[list[int], list[int]]:
    """Split a padded micro-batch of ≥ 2 sequences into its longer and its shorter half (less padding than mixing)."""
    order = sorted(mb, key=lambda j: (-lengths[j], j))
    half = len(order) // 2
    return sorted(order[:half]), sorted(order[half:])


@dataclass
class BalanceStats:
    """What ``balance_across_dp`` produced. Token loads are real (unpadded) tokens."""

    rank_tokens: list[int]
    imbalance: float  # max / min rank load (1.0 = perfect; inf when a rank has no tokens but another has)
    num_micro_batches: int  # per rank (equal on every rank)
    empty_micro_batches: int  # over all ranks
    split_micro_batches: int  # extra micro-batches made by splitting, to equalize counts
    max_micro_batch_tokens: int
    real_tokens: int
    padded_tokens: int
    padding_waste: float  # padded / real − 1 (see module docstring)
    pad_to_longest_waste: float  # the same micro-batches, each padded to k × its longest
    layout: str = "thd"
    sequences_per_rank: list[int] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"ranks={len(self.rank_tokens)} micro-batches/rank={self.num_micro_batches} "
            f"(empty {self.empty_micro_batches}, split {self.split_micro_batches}) "
            f"load max/min={self.imbalance:.4f} waste={self.padding_waste:.2%} "
            f"(pad-to-longest {self.pad_to_longest_waste:.2%})"
        )


def balance_across_dp(
    lengths: Sequence[int], dp_size: int, max_tokens: int, geometry: Geometry | None = None
) -> tuple[list[list[list[int]]], BalanceStats]:
    """Partition sequences over ``dp_size`` ranks with equal token loads, then form each rank's micro-batches.

    Returns ``(micro_batches, stats)``: ``micro_batches[rank][k]`` is the list of sequence indices of micro-batch k
    on ``rank``; every rank has the same number of micro-batches (see the module docstring for how counts are
    equalized and how the actor must run an empty micro-batch). Partitioning is Karmarkar–Karp with a move/swap
    refinement (``partition_karmarkar_karp``). ``geometry`` (default: packed, no padding) decides the layout: packed
    micro-batches are best-fit decreasing over the slot lengths (``pack_by_token_budget``, against the budget rounded
    down to the row multiple so the rounded row still fits), padded ones length-bucketed (``pack_padded``).
    """
    if dp_size < 1:
        raise ValueError(f"dp_size = {dp_size}: must be >= 1")
    geometry = geometry or Geometry("thd")
    _check_lengths(lengths, max_tokens)
    shares = partition_karmarkar_karp(lengths, dp_size)
    if geometry.layout == "padded":
        per_rank = [pack_padded(lengths, max_tokens, indices=share) for share in shares]
        split = _split_padded
    else:
        slots = [round_up(n, geometry.slot_multiple) for n in lengths]
        budget = max_tokens // geometry.total_multiple * geometry.total_multiple
        per_rank = [pack_by_token_budget(slots, budget, indices=share) for share in shares]
        split = _split_in_two
    target = max((len(mbs) for mbs in per_rank), default=0)
    splits = empties = 0
    for mbs in per_rank:
        while len(mbs) < target:
            # split the micro-batch with the most tokens among those holding ≥ 2 sequences
            candidates = [k for k, mb in enumerate(mbs) if len(mb) >= 2]
            if candidates:
                k = max(candidates, key=lambda j: (sum(lengths[i] for i in mbs[j]), -j))
                mbs[k : k + 1] = list(split(lengths, mbs[k]))
                splits += 1
            else:
                mbs.append([])
                empties += 1
    loads = [sum(lengths[i] for i in share) for share in shares]
    lo, hi = min(loads, default=0), max(loads, default=0)
    imbalance = 1.0 if hi == 0 else (hi / lo if lo > 0 else float("inf"))
    flat = [mb for mbs in per_rank for mb in mbs]
    real = sum(lengths)
    padded = _padded_tokens(lengths, flat, geometry)
    stats = BalanceStats(
        rank_tokens=loads,
        imbalance=imbalance,
        num_micro_batches=target,
        empty_micro_batches=empties,
        split_micro_batches=splits,
        max_micro_batch_tokens=max((geometry.cost([lengths[i] for i in mb]) for mb in flat), default=0),
        real_tokens=real,
        padded_tokens=padded,
        padding_waste=padded / real - 1 if real else 0.0,
        pad_to_longest_waste=pad_to_longest_waste(lengths, flat),
        layout=geometry.layout,
        sequences_per_rank=[len(s) for s in shares],
    )
    return per_rank, stats


def _padded_tokens(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]], geometry: Geometry) -> int:
    return sum(geometry.cost([lengths[i] for i in mb]) for mb in micro_batches)


def padding_waste(
    lengths: Sequence[int], micro_batches: Sequence[Sequence[int]], geometry: Geometry | None = None
) -> float:
    """Σ geometry.cost(micro-batch) / real tokens − 1 (an empty micro-batch costs its dummy); default: packed."""
    real = sum(lengths[i] for mb in micro_batches for i in mb)
    return _padded_tokens(lengths, micro_batches, geometry or Geometry("thd")) / real - 1 if real else 0.0


def pad_to_longest_waste(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]]) -> float:
    """Padded [k, longest] layout: Σ k × longest / real tokens − 1."""
    real = sum(lengths[i] for mb in micro_batches for i in mb)
    padded = sum(len(mb) * max(lengths[i] for i in mb) for mb in micro_batches if mb)
    return padded / real - 1 if real else 0.0


def split_mini_batches(num_items: int, num_updates: int) -> list[range]:
    """Contiguous, equal-size index ranges, one per optimizer update (``num_items`` must divide evenly)."""
    if num_updates < 1:
        raise ValueError(f"num_updates = {num_updates}: must be >= 1")
    if num_items < 0 or num_items % num_updates:
        raise ValueError(f"num_items = {num_items} is not divisible by num_updates = {num_updates}")
    size = num_items // num_updates
    return [range(k * size, (k + 1) * size) for k in range(num_updates)]


# ----------------------------------------------------------------------------------------------------------------------
# Packed layout of one micro-batch


@dataclass
class PackedSequences:
    """One packed micro-batch (THD layout with batch dimension 1).

    ``tokens``/``position_ids``/``valid_mask`` are [1, T]; position ids restart at 0 for every sequence;
    ``valid_mask`` is True on real tokens (the actor ANDs it with its response mask to get the loss mask).
    ``cu_seqlens`` (int32, [n+1]) are the cumulative REAL lengths (TE ``cu_seqlens_q/kv``); ``cu_seqlens_padded``
    are the offsets of each sequence's slot in ``tokens`` (TE ``cu_seqlens_q/kv_padded``; equal to ``cu_seqlens``
    without padding). Sequence j occupies ``tokens[0, cu_seqlens_padded[j] : cu_seqlens_padded[j] + seq_lens[j]]``.
    ``max_seqlen`` is the longest slot (``Geometry.slots``). Padding tokens have ``valid_mask`` False. An empty
    micro-batch is one dummy sequence of pad tokens (``num_sequences`` 0, ``valid_mask`` all False) so that the actor
    can run it like any other and add zero loss.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    valid_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    seq_lens: list[int]
    slot_lens: list[int]
    max_seqlen: int
    num_sequences: int

    @property
    def total_tokens(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_real_tokens(self) -> int:
        return sum(self.seq_lens) if self.num_sequences else 0

    @property
    def offsets(self) -> list[int]:
        """Where each sequence starts in the flattened [T] row."""
        return self.cu_seqlens_padded[:-1].tolist()

    def unpack(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split a per-token tensor [1, T, ...] (or [T, ...]) back into one tensor per real sequence."""
        t = self.total_tokens
        flat = values[0] if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == t else values
        if flat.shape[0] != t:
            raise ValueError(f"values has {flat.shape[0]} tokens, the packed micro-batch has {self.total_tokens}")
        if not self.num_sequences:
            return []
        return [flat[o : o + n] for o, n in zip(self.offsets, self.seq_lens)]


def pack_sequences(
    seqs: Sequence[torch.Tensor], geometry: Geometry | None = None, *, pad_id: int = 0
) -> PackedSequences:
    """Concatenate 1-D token tensors into one packed row, slots and total padded as ``geometry`` requires (default:
    no padding). ``seqs == []`` gives the dummy micro-batch described in the class docstring."""
    geometry = geometry or Geometry("thd")
    for j, s in enumerate(seqs):
        if s.dim() != 1 or s.numel() == 0:
            raise ValueError(f"seqs[{j}] has shape {tuple(s.shape)}: expected a non-empty 1-D tensor of token ids")
    empty = len(seqs) == 0
    if empty:
        seqs = [torch.full((geometry.dummy_tokens,), pad_id, dtype=torch.long)]
    seq_lens = [int(s.numel()) for s in seqs]
    slot_lens, total, max_seqlen = geometry.slots(seq_lens)
    tokens = torch.full((total,), pad_id, dtype=torch.long)
    positions = torch.empty(total, dtype=torch.long)
    valid_mask = torch.zeros(total, dtype=torch.bool)
    offset = 0
    for s, n, slot in zip(seqs, seq_lens, slot_lens):
        tokens[offset : offset + n] = s.to(torch.long)
        positions[offset : offset + slot] = torch.arange(slot)  # pads continue the positions of their slot
        valid_mask[offset : offset + n] = not empty
        offset += slot
    zero = torch.zeros(1, dtype=torch.int32)
    return PackedSequences(
        tokens=tokens[None],
        position_ids=positions[None],
        valid_mask=valid_mask[None],
        cu_seqlens=torch.cat([zero, torch.tensor(seq_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)]),
        cu_seqlens_padded=torch.cat([zero, torch.tensor(slot_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)]),
        seq_lens=seq_lens,
        slot_lens=slot_lens,
        max_seqlen=max_seqlen,
        num_sequences=0 if empty else len(seq_lens),
    )
