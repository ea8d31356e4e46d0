"""Group-normalized advantages against numpy; degenerate groups; broadcast to tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_dapo.algo import group_advantages, token_advantages

pytestmark = pytest.mark.timeout(60)


def test_known_groups_match_numpy():
    rewards = np.array([[1.0, -1.0, -1.0, 1.0, 1.0, -0.25], [-1.0, -1.0, -0.5, 1.0, -1.0, -1.0]])
    expected = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + 1e-6)
    got = group_advantages(torch.tensor(rewards, dtype=torch.float32))
    assert got.dtype == torch.float32 and got.shape == rewards.shape
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-7)


def test_random_groups_match_numpy_with_custom_eps():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(7, 16))
    expected = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + 0.1)
    got = group_advantages(torch.tensor(rewards), eps=0.1)
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)


def test_unbiased_std_not_biased():
    # two samples: unbiased std of [1, -1] is sqrt(2); biased would be 1
    got = group_advantages(torch.tensor([[1.0, -1.0]], dtype=torch.float64), eps=1e-12)
    assert got[0, 0].item() == pytest.approx(1 / np.sqrt(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("group_size", [3, 7, 16])
@pytest.mark.parametrize("value", [1.0, -1.0, 0.1, -0.7312, 0.7, 2.9])
def test_all_equal_groups_are_exactly_zero(value, group_size, dtype):
    # e.g. float64 mean([0.7] * 7) != 0.7 by an ulp: without care that becomes 1e-10 / eps, not 0
    rewards = torch.full((3, group_size), value, dtype=dtype)
    rewards[1] = 1.0  # another constant group
    got = group_advantages(rewards)
    assert torch.isfinite(got).all()
    assert (got == 0).all()


def test_mixed_batch_constant_rows_zero_others_normalized():
    rewards = torch.tensor([[0.1] * 8, [1.0, -1.0, 1.0, -1.0, 1.0, 1.0, -1.0, -1.0]])
    got = group_advantages(rewards)
    assert (got[0] == 0).all()
    assert got[1].sum().abs().item() < 1e-6
    assert got[1].std().item() == pytest.approx(1.0, rel=1e-5)


def test_group_of_one_gives_zeros():
    got = group_advantages(torch.tensor([[1.0], [-1.0], [0.3]]))
    assert torch.isfinite(got).all() and (got == 0).all()


def test_integer_rewards_give_float32():
    got = group_advantages(torch.tensor([[1, 0, 0, 1]]))
    assert got.dtype == torch.float32
    assert got[0, 0].item() == pytest.approx(0.5 / np.std([1, 0, 0, 1], ddof=1), rel=1e-5)


def test_bad_rewards_are_named():
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match=r"rewards\[1, 2\]"):
        group_advantages(torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, float("nan")]]))
    with pytest.raises(ValueError, match="algo.adv_eps"):
        group_advantages(torch.zeros(2, 2), eps=0)


def test_token_advantages_broadcast_group_major():
    adv = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    got = token_advantages(adv, mask)
    expected = torch.tensor([[1.0, 1.0, 0.0], [2.0, 0.0, 0.0], [3.0, 3.0, 3.0], [0.0, 0.0, 0.0]])
    assert torch.equal(got, expected)
    assert torch.equal(token_advantages(adv.reshape(-1), mask.bool()), expected)
    with pytest.raises(ValueError, match="mask"):
        token_advantages(adv, mask[:3])
