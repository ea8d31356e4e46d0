"""Micro-batch geometry: the padding rules of TE (FP8, context parallel) and megatron (sequence parallel) hold on
random length mixes, and padding never reaches the loss or its token denominator."""

import itertools
import random

import pytest
import torch

from megatron_dapo.actor.actor import per_position_arrays
from megatron_dapo.data.geometry import Geometry, micro_batch_geometry
from megatron_dapo.data.packing import balance_across_dp, pack_sequences
from megatron_dapo.data.shared_prompt import shared_prompt_batch
from megatron_dapo.types import Sequence

SETTINGS = [  # (fp8, tp, sequence_parallel, cp)
    (fp8, tp, sp, cp)
    for fp8, tp, sp, cp in itertools.product([False, True], [1, 2, 4, 8], [False, True], [1, 2, 4])
    if not (sp and tp == 1)
]


def random_lengths(rng, n=None):
    return [rng.choice([1, 2, 3, rng.randint(1, 40), rng.randint(1, 3000)]) for _ in range(n or rng.randint(1, 30))]


@pytest.mark.parametrize("fp8,tp,sp,cp", SETTINGS)
def test_thd_rules_hold_on_random_mixes(fp8, tp, sp, cp):
    g = micro_batch_geometry(True, tp=tp, cp=cp, sequence_parallel=sp, fp8=fp8)
    rng = random.Random(hash((fp8, tp, sp, cp)) & 0xFFFF)
    for _ in range(50):
        lengths = random_lengths(rng)
        slots, total, max_seqlen = g.slots(lengths)
        assert all(s >= n for s, n in zip(slots, lengths)) and sum(slots) == total  # the slots cover the row
        if cp > 1:
            assert all(s % (2 * cp) == 0 for s in slots)  # TE context_parallel.cu:100-103
        per_rank = total // cp
        assert per_rank * cp == total
        if sp:
            assert per_rank % tp == 0  # megatron mappings.py:171-174
        if fp8:
            assert per_rank % 16 == 0  # TE cuBLAS wgrad leading dimension (gathered tokens)
            assert (per_rank // (tp if sp else 1)) % 8 == 0  # TE assert_dim_for_fp8_exec on the local shard
        assert max_seqlen == max(slots)  # padded, global: TE and megatron RoPE index by the padded slot
        assert len(slots) == 1 or max_seqlen < total  # megatron rope_utils.py:211 would renumber across the row
        assert g.cost(lengths) == total
        assert g.dummy_tokens % g.total_multiple == 0 and g.dummy_tokens >= 1


def test_multiples_by_hand():
    assert micro_batch_geometry(False) == Geometry("padded")
    assert micro_batch_geometry(True) == Geometry("thd", 1, 1)
    assert micro_batch_geometry(True, tp=2, cp=2, sequence_parallel=True) == Geometry("thd", 4, 4)
    assert micro_batch_geometry(True, tp=4, cp=2, sequence_parallel=True, fp8=True) == Geometry("thd", 4, 128)
    assert micro_batch_geometry(True, tp=8, fp8=True) == Geometry("thd", 1, 16)
    assert micro_batch_geometry(True, tp=3, cp=2, sequence_parallel=True) == Geometry("thd", 4, 12)
    with pytest.raises(ValueError, match="Transformer Engine"):
        micro_batch_geometry(False, cp=2)
    g = micro_batch_geometry(True, cp=2, fp8=True)
    assert g.slots([3, 5]) == ([4, 28], 32, 28)  # slots of 4; the row to 32: the extra goes into the last slot


def _seqs(rng, lengths):
    out = []
    for n in lengths:
        prompt = rng.randint(1, n) if n > 1 else 1
        s = Sequence(torch.randint(1, 50, (max(n, 2),)), prompt_len=min(prompt, max(n, 2) - 1), advantage=rng.random())
        s.loss_mask = torch.tensor([float(rng.random() > 0.2) for _ in range(s.response_len)])
        s.old_logprobs = -torch.rand(s.response_len)
        out.append(s)
    return out


@pytest.mark.parametrize("setting", [(False, 1, False, 1), (True, 4, True, 2), (True, 2, False, 4)])
def test_padding_never_reaches_the_loss(setting):
    rng = random.Random(7)
    fp8, tp, sp, cp = setting
    g = micro_batch_geometry(True, tp=tp, cp=cp, sequence_parallel=sp, fp8=fp8)
    for _ in range(20):
        seqs = _seqs(rng, random_lengths(rng, rng.randint(1, 12)))
        ranks, _ = balance_across_dp([int(s.tokens.numel()) for s in seqs], 2, 8192, g)
        seen = 0
        for idx in [mb for r in ranks for mb in r]:
            chosen = [seqs[i] for i in idx]
            layout = pack_sequences([s.tokens for s in chosen], g)
            a = per_position_arrays(chosen, idx, layout.offsets, layout.total_tokens)
            flat, v = layout.tokens.reshape(-1), a["valid"]
            # valid positions are exactly the response-predicting ones; their labels are the next real tokens
            assert int(v.sum()) == sum(s.response_len for s in chosen)
            assert not v[-1] and torch.equal(a["labels"][v], flat[1:][v[:-1]])
            responses = [s.tokens[s.prompt_len :] for s in chosen]
            assert torch.equal(a["labels"][v], torch.cat(responses) if responses else a["labels"][v])
            # the loss mask sums over valid positions only, to what the sequences carry (the denominator's input)
            assert a["loss_mask"][~v].sum() == 0 and a["advantages"][~v].abs().sum() == 0
            assert a["loss_mask"][v].sum() == pytest.approx(float(sum(s.loss_mask.sum() for s in chosen)))
            seen += len(idx)
        assert seen == len(seqs)


def test_padded_rows_target_exactly_the_response_tokens():
    """The local spec's rows (shared prompts, right padding): one target per response token, none on padding."""
    rng = random.Random(3)
    for _ in range(20):
        seqs = _seqs(rng, random_lengths(rng, rng.randint(1, 12)))
        rows = [[i] for i in range(len(seqs))]
        b = shared_prompt_batch([s.tokens for s in seqs], [s.prompt_len for s in seqs], rows)
        assert torch.equal(b.labels, torch.cat([s.tokens[s.prompt_len :] for s in seqs]))
        flat = b.tokens.reshape(-1)
        assert torch.equal(flat[b.target_index + 1], b.labels)  # one row per sequence: the next position
        assert b.target_seq.tolist() == [i for i, s in enumerate(seqs) for _ in range(s.response_len)]
