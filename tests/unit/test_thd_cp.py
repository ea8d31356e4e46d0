"""Our THD context-parallel slicing (actor/thd_cp.py) against megatron-core 0.16.1's ``get_thd_batch_on_this_cp_rank``.

0.16.1's function calls TE's CUDA kernel ``thd_get_partitioned_indices``, which has no CPU build; the reference here
feeds it a literal, scalar transcription of that kernel (TE ``common/fused_attn/context_parallel.cu``,
``thd_partition_indices_kernel`` + ``binary_search``: one loop iteration per CUDA thread). Where megatron-core no
longer has the function (0.19.2) the kernel transcription alone is the reference.
"""

from __future__ import annotations

import random
import types

import pytest
import torch

from megatron_dapo.actor import thd_cp


def _te_binary_search(target: int, array: list[int], length: int) -> int:
    left, right = 1, length - 1
    while left < right:
        mid = (left + right) // 2
        if array[mid] <= target:
            left = mid + 1
        else:
            right = mid
    return left - 1


def _te_kernel(cu_seqlens, total_tokens: int, world_size: int, rank: int) -> torch.Tensor:
    cu = [int(x) for x in cu_seqlens]
    batch = len(cu) - 1
    assert all(x % (world_size * 2) == 0 for x in cu)
    cu_s = [x // world_size for x in cu]
    out = []
    for token_id in range(total_tokens // world_size):
        seq_id = _te_binary_search(token_id, cu_s, batch + 1)
        seq_len = cu_s[seq_id + 1] - cu_s[seq_id]
        index = token_id - cu_s[seq_id]
        offset = rank if index < seq_len // 2 else (world_size - 1) * 2 - rank
        out.append(index + cu_s[seq_id] * world_size + seq_len // 2 * offset)
    return torch.tensor(out, dtype=torch.int32)


_fake_tex = types.SimpleNamespace(thd_get_partitioned_indices=_te_kernel)


def _random_case(rng: random.Random, cp: int):
    """A packed row of 1-6 sequences, each padded to a multiple of 2·cp (some empty), with every array the actor
    sends through the split: tokens, position ids and the per-position float/long/bool arrays."""
    lengths = [rng.choice([0, 1, 2, 3]) * 2 * cp + 2 * cp * rng.randint(0, 3) for _ in range(rng.randint(1, 6))]
    if sum(lengths) == 0:
        lengths[0] = 2 * cp
    padded = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    real = torch.tensor(
        [0, *torch.tensor([max(n - rng.randint(0, 2 * cp - 1), 0) for n in lengths]).cumsum(0).tolist()]
    )
    total = int(padded[-1])
    g = torch.Generator().manual_seed(rng.randint(0, 2**31))
    batch = {
        "tokens": torch.randint(0, 1000, (1, total), generator=g),
        "position_ids": torch.randint(0, 64, (1, total), generator=g),
        "labels": torch.randint(0, 1000, (1, total), generator=g),
        "valid": torch.rand(1, total, generator=g) > 0.5,
        "seq_id": torch.randint(-1, 6, (1, total), generator=g),
        "old_logprobs": torch.randn(1, total, generator=g),
        "advantages": torch.randn(1, total, generator=g),
        "loss_mask": torch.rand(1, total, generator=g),
    }
    return batch, real, padded, torch.tensor([max(lengths)])


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_partition_index_equals_te_kernel(cp):
    rng = random.Random(cp)
    for _ in range(25):
        _, _, padded, _ = _random_case(rng, cp)
        total = int(padded[-1])
        for rank in range(cp):
            ours = thd_cp.thd_partitioned_indices(padded, total, cp, rank)
            assert torch.equal(ours.to(torch.int32), _te_kernel(padded, total, cp, rank)), (padded.tolist(), rank)
        # the ranks' slices partition the row
        every = torch.cat([thd_cp.thd_partitioned_indices(padded, total, cp, r) for r in range(cp)])
        assert sorted(every.tolist()) == list(range(total))


def test_partition_index_refuses_indivisible_lengths():
    with pytest.raises(ValueError, match="divisible by 2\\*cp_size = 4"):
        thd_cp.thd_partitioned_indices(torch.tensor([0, 4, 10]), 10, 2, 0)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_matches_megatron_core_0_16_1(monkeypatch, cp):
    core_utils = pytest.importorskip("megatron.core.utils")
    upstream = getattr(core_utils, "get_thd_batch_on_this_cp_rank", None)
    if upstream is None:
        pytest.skip("this megatron-core has no get_thd_batch_on_this_cp_rank (removed after 0.16.1)")
    monkeypatch.setattr(core_utils, "tex", _fake_tex)
    monkeypatch.setattr(core_utils, "is_te_min_version", lambda *a, **k: True)
    rng = random.Random(100 + cp)
    for _ in range(20):
        batch, real, padded, max_seqlen = _random_case(rng, cp)
        for rank in range(cp):
            ours, ours_params = thd_cp.get_thd_batch_on_this_cp_rank(batch, real, padded, max_seqlen, cp, rank)
            theirs, their_params = upstream(dict(batch), real, padded, max_seqlen, cp, rank)
            assert ours.keys() == theirs.keys()
            for key in ours:
                assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
            assert vars(ours_params).keys() == vars(their_params).keys()
            for field, value in vars(their_params).items():
                mine = getattr(ours_params, field)
                assert torch.equal(mine, value) if torch.is_tensor(value) else mine == value, field


def test_cp_rank_from_parallel_state(monkeypatch):
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: 1)
    batch, real, padded, max_seqlen = _random_case(random.Random(7), 2)
    out, params = thd_cp.get_thd_batch_on_this_cp_rank(batch, real, padded, max_seqlen)
    index = _te_kernel(padded, int(padded[-1]), 2, 1).long()
    assert torch.equal(out["advantages"], batch["advantages"][:, index])  # per-position arrays are sliced too
    assert out["tokens"].shape[1] == int(padded[-1]) // 2
    assert params.qkv_format == "thd" and params.max_seqlen_q == int(max_seqlen[0])
    assert batch["tokens"].shape[1] == int(padded[-1])  # the caller's dict is left as it was


def test_actor_thd_micro_batch_splits_every_per_position_array(monkeypatch):
    """The actor's own THD micro-batch (built on CPU with a THD geometry, as on TE) at CP=2: each response token
    lands on exactly one CP rank with its own label, sequence, offset, old logprob, advantage and loss mask."""
    from megatron.core import parallel_state

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.dist import teardown
    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.data.geometry import Geometry
    from megatron_dapo.types import Sequence

    actor = MegatronActor(
        load_config("demo_cpu", ["train.batch_prompts=2", "train.mini_batch_prompts=2", "algo.group_size=2"])
    )
    try:
        g = torch.Generator().manual_seed(3)
        seqs = []
        for n, p in ((11, 4), (7, 2), (16, 9)):
            r = n - p
            s = Sequence(torch.randint(0, 25, (n,), generator=g), p, advantage=float(torch.randn(1, generator=g)))
            s.old_logprobs, s.loss_mask = -torch.rand(r, generator=g), (torch.rand(r, generator=g) > 0.3).long()
            seqs.append(s)
        actor.geometry = Geometry("thd", slot_multiple=4, total_multiple=4)

        def tokens_of(mb):
            keys = ("seq_id", "resp_off", "labels", "old_logprobs", "advantages", "loss_mask")
            return sorted(zip(*(mb["sel_" + k].tolist() for k in keys)))

        whole = actor._micro_batch(seqs, [[0], [1], [2]])
        assert len(tokens_of(whole)) == sum(s.response_len for s in seqs)
        monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
        parts = []
        for rank in (0, 1):
            monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda rank=rank: rank)
            mb = actor._micro_batch(seqs, [[0], [1], [2]])
            assert mb["tokens"].shape[1] == whole["tokens"].shape[1] // 2
            parts += tokens_of(mb)
        assert sorted(parts) == tokens_of(whole)
    finally:
        teardown()
