"""keep_groups and DynamicSampler: refill, exact truncation, order, bound, pass-through, resume."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.algo import DynamicSampler, DynamicSamplingError, keep_groups

pytestmark = pytest.mark.timeout(60)

G = 4


def batch(start: int, num_correct: list[int]):
    """Groups named by a running index, and a correctness matrix with the given #correct per group."""
    groups = [f"p{start + i}" for i in range(len(num_correct))]
    correct = torch.tensor([[j < k for j in range(G)] for k in num_correct], dtype=torch.bool)
    return groups, correct


def test_keep_groups_on_correctness():
    g = torch.Generator().manual_seed(0)
    correct = torch.rand(50, 8, generator=g) < 0.5
    correct[0] = True
    correct[1] = False
    got = keep_groups(correct)
    expected = [0 < sum(row) < 8 for row in correct.tolist()]
    assert got.tolist() == expected
    assert not got[0] and not got[1]


def test_keep_groups_rejects_rewards():
    with pytest.raises(TypeError, match="correct"):
        keep_groups(torch.tensor([[1.0, -1.0]]))  # shaped ±1 rewards, not correctness


def test_refills_across_batches_truncates_to_b_and_keeps_order():
    sampler = DynamicSampler(5, max_gen_batches=3)
    assert sampler.add(*batch(0, [0, 2, 4, 1])) == 2  # keeps p1, p3
    assert not sampler.full and sampler.missing == 3
    assert sampler.add(*batch(4, [4, 4, 0, 0])) == 0
    assert sampler.add(*batch(8, [3, 1, 0, 2, 1])) == 4  # p8, p9, p11, p12 -> one surplus
    assert sampler.full
    taken = sampler.take()
    assert taken == ["p1", "p3", "p8", "p9", "p11"]
    s = sampler.stats()
    assert (s["num_gen_batches"], s["kept"], s["surplus"]) == (3, 6, 1)
    assert (s["dropped_all_correct"], s["dropped_all_wrong"]) == (3, 4)
    assert s["keep_rate"] == pytest.approx(6 / 13)
    assert s["steps"] == 1


def test_raises_at_the_bound_naming_the_keys():
    sampler = DynamicSampler(4, max_gen_batches=2)
    sampler.add(*batch(0, [4, 1, 0]))
    with pytest.raises(DynamicSamplingError) as err:
        sampler.add(*batch(3, [0, 0, 2]))
    msg = str(err.value)
    assert "kept 2 of the 4" in msg and "after 2 generation batches" in msg
    assert "algo.max_gen_batches" in msg and "algo.gen_batch_prompts" in msg
    with pytest.raises(DynamicSamplingError):
        sampler.take()


def test_filling_on_the_last_allowed_batch_does_not_raise():
    sampler = DynamicSampler(2, max_gen_batches=2)
    sampler.add(*batch(0, [4, 1]))
    sampler.add(*batch(2, [2, 0]))
    assert sampler.take() == ["p1", "p2"]


def test_unbounded_never_raises():
    for bound in (0, -1):
        sampler = DynamicSampler(3, max_gen_batches=bound)
        for i in range(200):
            sampler.add(*batch(4 * i, [0, 4, 4, 0]))
        assert sampler.num_gen_batches == 200 and not sampler.full
        sampler.add(*batch(1000, [1, 2, 3, 3]))
        assert sampler.take() == ["p1000", "p1001", "p1002"]
        assert sampler.surplus == 1


def test_counters_reset_per_step_and_totals_accumulate():
    sampler = DynamicSampler(2, max_gen_batches=5)
    sampler.add(*batch(0, [4, 1, 2, 3]))
    sampler.take()
    sampler.add(*batch(4, [0, 1]))
    assert sampler.num_gen_batches == 1 and sampler.kept == 1 and sampler.surplus == 0
    sampler.add(*batch(6, [1]))
    assert sampler.take() == ["p5", "p6"]
    s = sampler.stats()
    assert s["num_gen_batches"] == 2 and s["total_num_gen_batches"] == 3
    assert s["total_kept"] == 5 and s["total_surplus"] == 1 and s["steps"] == 2


def test_state_dict_round_trips():
    a = DynamicSampler(2, max_gen_batches=5)
    a.add(*batch(0, [4, 1, 0]))
    a.add(*batch(3, [2, 3, 1]))
    a.take()
    state = a.state_dict()
    b = DynamicSampler(2, max_gen_batches=5)
    b.load_state_dict(state)
    assert b.state_dict() == state and b.stats() == a.stats()
    # both continue identically
    for s in (a, b):
        s.add(*batch(10, [0, 2, 2]))
        s.take()
    assert a.state_dict() == b.state_dict()
    with pytest.raises(KeyError, match="total_kept"):
        b.load_state_dict({k: v for k, v in state.items() if k != "total_kept"})


def test_pass_through_when_disabled():
    sampler = DynamicSampler(3, max_gen_batches=1, enabled=False)
    sampler.add(*batch(0, [4, 0, 4, 2]))
    assert sampler.full
    assert sampler.take() == ["p0", "p1", "p2"]
    s = sampler.stats()
    assert (s["kept"], s["surplus"], s["dropped_all_correct"], s["dropped_all_wrong"]) == (4, 1, 0, 0)
    sampler.add(["a", "b", "c"], None)
    assert sampler.take() == ["a", "b", "c"]


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="train.batch_prompts"):
        DynamicSampler(0)
    sampler = DynamicSampler(3)
    with pytest.raises(ValueError, match="rows"):
        sampler.add(["a"], torch.zeros(2, G, dtype=torch.bool))
    with pytest.raises(ValueError, match="correct is None"):
        sampler.add(["a"], None)
    sampler.add(*batch(0, [1]))
    with pytest.raises(ValueError, match="G = 3"):
        sampler.add(["x"], torch.zeros(1, 3, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------------------------------
# prompt-order cut of a streaming batch


def _correct(pattern: str) -> torch.Tensor:
    return torch.tensor([c == "1" for c in pattern])


def test_groups_finishing_in_reverse_order_are_cut_in_prompt_order():
    from megatron_dapo.algo.sampling import PromptOrderCollector

    # prompts 0..7; informative (mixed) ones: 1, 2, 4, 6. Needed: 2 -> the cut is after prompt 2.
    patterns = ["1111", "1010", "0110", "0000", "0001", "1111", "1100", "0000"]
    c = PromptOrderCollector(len(patterns), needed=2)
    finished = []
    for p in reversed(range(len(patterns))):  # an engine that finishes the last prompt first
        finished.append(p)
        if c.add(p, f"group{p}", _correct(patterns[p])):
            break
    assert finished == list(reversed(range(8)))  # the cut is only known once prompts 0..2 are in
    groups, correct = c.take()
    assert groups == ["group0", "group1", "group2"]  # in prompt order; 4 and 6 (finished earlier) are surplus
    assert correct.tolist() == [[True] * 4, [True, False, True, False], [False, True, True, False]]
    # finish order can only delay the cut, never change which groups are kept
    forward = PromptOrderCollector(len(patterns), needed=2)
    assert [p for p in range(8) if not forward.add(p, f"group{p}", _correct(patterns[p]))] == [0, 1]
    assert forward.take()[0] == groups


def test_without_dynamic_sampling_every_group_counts_and_an_uncut_batch_returns_all():
    from megatron_dapo.algo.sampling import PromptOrderCollector

    c = PromptOrderCollector(4, needed=3, informative_only=False)
    for p in (2, 0, 1):
        done = c.add(p, p, _correct("0000"))
    assert done and c.take()[0] == [0, 1, 2]
    short = PromptOrderCollector(3, needed=5)
    for p in (1, 0, 2):
        assert not short.add(p, p, _correct("01"))
    assert short.take()[0] == [0, 1, 2]  # too few informative groups: the whole batch, in order
