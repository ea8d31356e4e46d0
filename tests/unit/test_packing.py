"""Token-budget micro-batches, DP balancing, and the two layouts: packed THD rows and padded [B, L] batches."""

import itertools
import random

import numpy as np
import pytest
import torch

from megatron_dapo.data.geometry import Geometry
from megatron_dapo.data.packing import (
    balance_across_dp,
    pack_by_token_budget,
    pack_padded,
    pack_sequences,
    pad_to_longest_waste,
    padding_waste,
    partition_karmarkar_karp,
    split_mini_batches,
)

pytestmark = pytest.mark.timeout(120)


def dapo_lengths(n: int, seed: int = 0) -> list[int]:
    """DAPO-like: prompts 100–2048 tokens, responses lognormal with mean ≈ 4.5k, clipped to 20480."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(100, 2049, n)
    responses = np.clip(rng.lognormal(np.log(3300), 0.8, n), 50, 20480).astype(int)
    return (prompts + responses).tolist()


def check_cover(micro_batches, n):
    flat = sorted(i for mb in micro_batches for i in mb)
    assert flat == list(range(n)), "every index exactly once"


# ----------------------------------------------------------------------------------------------------------------------
# pack_by_token_budget


@pytest.mark.parametrize("seed,budget", [(0, 64), (1, 100), (2, 1000), (3, 37)])
def test_pack_respects_budget_and_covers(seed, budget):
    rng = random.Random(seed)
    lengths = [rng.randint(1, budget) for _ in range(500)]
    mbs = pack_by_token_budget(lengths, budget)
    check_cover(mbs, len(lengths))
    assert all(sum(lengths[i] for i in mb) <= budget for mb in mbs)
    assert mbs == pack_by_token_budget(lengths, budget), "deterministic"
    # never two micro-batches that could have been merged (a property of any-fit packing)
    sums = sorted(sum(lengths[i] for i in mb) for mb in mbs)
    assert len(sums) < 2 or sums[0] + sums[1] > budget


def _optimal_bins(lengths, budget):
    """Brute force: fewest bins over all assignments (small n)."""
    n = len(lengths)
    for k in range(1, n + 1):
        for assign in itertools.product(range(k), repeat=n):
            if assign[0] != 0:
                continue
            loads = [0] * k
            for i, b in enumerate(assign):
                loads[b] += lengths[i]
            if max(loads) <= budget:
                return k
    return n


def test_pack_close_to_optimal_on_small_instances():
    rng = random.Random(7)
    for _ in range(40):
        budget = 20
        lengths = [rng.randint(1, budget) for _ in range(rng.randint(2, 7))]
        got = len(pack_by_token_budget(lengths, budget))
        opt = _optimal_bins(lengths, budget)
        assert opt <= got <= 11 / 9 * opt + 6 / 9, (lengths, got, opt)


def test_pack_too_long_names_sequence():
    with pytest.raises(ValueError, match=r"sequence 2 has 11 tokens.*max_tokens = 10"):
        pack_by_token_budget([3, 4, 11], 10)
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        pack_by_token_budget([3, -1], 10)


# ----------------------------------------------------------------------------------------------------------------------
# balance_across_dp


def _lpt_spread(lengths, parts):
    """Reference: greedy longest-processing-time partition (each item to the least-loaded part)."""
    loads = [0] * parts
    for n in sorted(lengths, reverse=True):
        loads[loads.index(min(loads))] += n
    return max(loads) - min(loads)


@pytest.mark.parametrize("n,dp", [(512 * 16, 16), (512, 16), (512, 8)])
def test_balance_dapo_mix(n, dp):
    lengths = dapo_lengths(n, seed=n + dp)
    assert 4000 < np.mean(lengths) - 1074 < 5000 and max(lengths) > 15000  # the mix is what it claims to be
    budget = 2048 + 20480
    ranks, stats = balance_across_dp(lengths, dp, budget, Geometry("thd", total_multiple=128))
    assert len(ranks) == dp
    check_cover([mb for r in ranks for mb in r], n)
    assert len({len(r) for r in ranks}) == 1, "equal micro-batch counts on every rank"
    assert stats.num_micro_batches == len(ranks[0])
    assert all(sum(lengths[i] for i in mb) <= budget for r in ranks for mb in r)
    loads = [sum(lengths[i] for mb in r for i in mb) for r in ranks]
    assert loads == stats.rank_tokens
    assert max(loads) / min(loads) <= 1.1
    assert stats.imbalance == pytest.approx(max(loads) / min(loads))
    assert max(loads) - min(loads) <= _lpt_spread(lengths, dp), "no worse than the greedy LPT reference"
    assert stats.padding_waste <= 0.05
    assert stats.pad_to_longest_waste >= stats.padding_waste - 0.01


def test_balance_equalizes_counts_with_split_or_empty():
    # {20, 1} vs {10, 10}: rank 0 needs 2 micro-batches, rank 1 splits its [10, 10] rather than idling
    ranks, stats = balance_across_dp([20, 10, 10, 1], 2, 20)
    assert [len(r) for r in ranks] == [2, 2] and stats.split_micro_batches == 1 and stats.empty_micro_batches == 0
    check_cover([mb for r in ranks for mb in r], 4)
    # {10, 10} vs {10, 1}: both ranks hold single-sequence micro-batches -> nothing to split -> an empty one
    ranks, stats = balance_across_dp([10, 10, 10], 2, 10)
    assert [len(r) for r in ranks] == [2, 2] and stats.empty_micro_batches == 1
    assert sum(mb == [] for r in ranks for mb in r) == 1
    assert stats.imbalance == 2.0
    # more ranks than sequences: idle ranks get empty micro-batches, never a deadlock-prone count mismatch
    ranks, stats = balance_across_dp([5, 7], 4, 10)
    assert [len(r) for r in ranks] == [1, 1, 1, 1] and stats.empty_micro_batches == 2
    assert stats.imbalance == float("inf")


def test_balance_random_invariants():
    rng = random.Random(3)
    for trial in range(30):
        budget = rng.choice([16, 50, 200])
        lengths = [rng.randint(1, budget) for _ in range(rng.randint(1, 80))]
        dp = rng.randint(1, 9)
        ranks, stats = balance_across_dp(lengths, dp, budget)
        check_cover([mb for r in ranks for mb in r], len(lengths))
        assert len({len(r) for r in ranks}) == 1, trial
        assert all(sum(lengths[i] for i in mb) <= budget for r in ranks for mb in r)


def test_karmarkar_karp_small_exact():
    # The classic example: KK (2-way) finds 8+7 = 15 = 6+5+4 for {8, 7, 6, 5, 4}.
    parts = partition_karmarkar_karp([8, 7, 6, 5, 4], 2)
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts) == [15, 15]


# ----------------------------------------------------------------------------------------------------------------------
# waste and mini-batches


def test_padding_waste_by_hand():
    lengths = [3, 5, 8]
    mbs = [[0, 1], [2]]
    assert padding_waste(lengths, mbs) == 0.0
    assert padding_waste(lengths, mbs, Geometry("thd", total_multiple=4)) == 0.0  # 8 and 8
    assert padding_waste(lengths, mbs, Geometry("thd", total_multiple=5)) == pytest.approx(20 / 16 - 1)  # 10 + 10
    assert pad_to_longest_waste(lengths, mbs) == pytest.approx((2 * 5 + 8) / 16 - 1)
    four = Geometry("thd", total_multiple=4)
    assert padding_waste(lengths, mbs + [[]], four) == pytest.approx(20 / 16 - 1)  # an empty one runs a 4-token dummy
    assert padding_waste(lengths, mbs, Geometry("padded")) == pytest.approx((2 * 5 + 8) / 16 - 1)


def test_split_mini_batches():
    parts = split_mini_batches(512 * 16, 16)
    assert len(parts) == 16 and all(len(p) == 512 for p in parts)
    assert [i for p in parts for i in p] == list(range(512 * 16))
    with pytest.raises(ValueError, match="num_items = 10 is not divisible by num_updates = 3"):
        split_mini_batches(10, 3)


# ----------------------------------------------------------------------------------------------------------------------
# packed layout


def test_pack_sequences_by_hand():
    a, b, c = torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([1, 2, 3, 4])
    p = pack_sequences([a, b, c])
    assert p.tokens.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert p.cu_seqlens_padded.tolist() == [0, 3, 5, 9] and p.max_seqlen == 4
    assert p.valid_mask.all() and p.num_real_tokens == 9
    assert [t.tolist() for t in p.unpack(p.tokens)] == [[5, 6, 7], [8, 9], [1, 2, 3, 4]]


def test_pack_sequences_with_padding():
    a, b = torch.tensor([5, 6, 7]), torch.tensor([8, 9])
    p = pack_sequences([a, b], Geometry("thd", slot_multiple=2, total_multiple=8), pad_id=0)
    # slots: 3 -> 4, 2 -> 2 (total 6), then the total is padded to 8 by extending the last slot
    assert p.tokens.tolist() == [[5, 6, 7, 0, 8, 9, 0, 0]]
    assert p.cu_seqlens.tolist() == [0, 3, 5]
    assert p.cu_seqlens_padded.tolist() == [0, 4, 8]
    assert p.max_seqlen == 4  # the longest padded slot, not the longest sequence (3)
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert p.valid_mask.tolist() == [[True, True, True, False, True, True, False, False]]
    assert [t.tolist() for t in p.unpack(p.tokens[0])] == [[5, 6, 7], [8, 9]]


def test_empty_micro_batch_is_a_zero_loss_dummy():
    p = pack_sequences([], Geometry("thd", total_multiple=128), pad_id=3)
    assert p.num_sequences == 0 and p.num_real_tokens == 0 and p.total_tokens == 128
    assert (p.tokens == 3).all() and not p.valid_mask.any()
    assert p.cu_seqlens.tolist() == [0, 128] and p.unpack(p.tokens) == []
    assert pack_sequences([]).total_tokens == 1


# ----------------------------------------------------------------------------------------------------------------------
# padded layout


@pytest.mark.parametrize("seed,budget", [(0, 64), (1, 256), (2, 1000)])
def test_pack_padded_respects_budget_buckets_by_length_and_covers(seed, budget):
    rng = random.Random(seed)
    lengths = [rng.randint(1, budget // 4) for _ in range(400)]
    mbs = pack_padded(lengths, budget)
    check_cover(mbs, len(lengths))
    assert all(len(mb) * max(lengths[i] for i in mb) <= budget for mb in mbs)
    # length-bucketed: micro-batches hold consecutive lengths of the sorted order, so they never interleave
    spans = sorted((min(lengths[i] for i in mb), max(lengths[i] for i in mb)) for mb in mbs)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    # and little is padded on a realistic mix (the dense [T, T] packed alternative does T / L times the work)
    assert padding_waste(lengths, mbs, Geometry("padded")) < 0.15


def test_padded_balance_equalizes_counts():
    lengths = [12, 11, 10, 3, 2, 2, 2, 1]
    ranks, stats = balance_across_dp(lengths, 2, 24, Geometry("padded"))
    check_cover([mb for r in ranks for mb in r], len(lengths))
    assert len({len(r) for r in ranks}) == 1 and stats.layout == "padded"
    assert all(len(mb) * max(lengths[i] for i in mb) <= 24 for r in ranks for mb in r if mb)
