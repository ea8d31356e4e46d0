"""Soft overlong punishment at the boundaries; overlong filter mask."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.algo import overlong_filter_mask, overlong_penalty, truncated_from_finish_reasons

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("max_len,cache", [(20480, 4096), (64, 16), (10, 10), (7, 3)])
def test_penalty_at_the_boundaries(max_len, cache):
    start = max_len - cache
    lengths = [0, start, start + 1, max_len, max_len + 1, 10 * max_len]
    expected = [0.0, 0.0, -1.0 / cache, -1.0, -1.0, -1.0]
    got = overlong_penalty(torch.tensor(lengths), max_len, cache, dtype=torch.float64)
    assert got.tolist() == expected
    got32 = overlong_penalty(lengths, max_len, cache)
    assert got32.dtype == torch.float32
    assert torch.equal(got32, torch.tensor(expected, dtype=torch.float32))


def test_penalty_is_linear_inside_the_window_and_scaled():
    max_len, cache = 100, 40
    lengths = torch.arange(0, 111)
    got = overlong_penalty(lengths, max_len, cache, factor=0.5, dtype=torch.float64)
    for length, value in zip(lengths.tolist(), got.tolist()):
        if length <= 60:
            assert value == 0.0
        elif length <= 100:
            assert value == pytest.approx(0.5 * (60 - length) / 40, abs=1e-15)
        else:
            assert value == -0.5
    assert (got.diff() <= 0).all()  # monotone non-increasing in length


def test_penalty_keeps_shape():
    lengths = torch.tensor([[1, 99], [100, 70]])
    assert overlong_penalty(lengths, 100, 40).shape == (2, 2)


def test_penalty_bad_arguments_name_the_key():
    with pytest.raises(ValueError, match="algo.overlong_cache"):
        overlong_penalty([1], 100, 0)
    with pytest.raises(ValueError, match="algo.overlong_cache"):
        overlong_penalty([1], 100, 101)
    with pytest.raises(TypeError, match="lengths"):
        overlong_penalty(torch.tensor([1.5]), 100, 10)


def test_overlong_filter_mask():
    truncated = truncated_from_finish_reasons(["stop", "length", None, "abort", "length"])
    assert truncated.tolist() == [False, True, False, False, True]
    keep = overlong_filter_mask(truncated)
    assert keep.dtype == torch.bool and keep.tolist() == [True, False, True, True, False]
    assert overlong_filter_mask([True, False]).tolist() == [False, True]
    with pytest.raises(TypeError, match="truncated"):
        overlong_filter_mask(torch.tensor([1, 0]))
