"""Reward shaping for over-long responses (DAPO, arXiv 2503.14476, §3.4).

Soft overlong punishment (eq. 13), for a response of |y| tokens, L_max = ``max_len``, L_cache = ``cache_len``:

    R_length(y) =  0                                   if |y| ≤ L_max − L_cache
                   ((L_max − L_cache) − |y|) / L_cache  if L_max − L_cache < |y| ≤ L_max
                   −1                                  if |y| > L_max

added to the correctness reward (times ``factor``). Overlong filtering instead masks truncated samples (those that
stopped because they hit the length limit, finish_reason == "length") out of the loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def overlong_penalty(
    lengths: torch.Tensor | Sequence[int],
    max_len: int,
    cache_len: int,
    factor: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The soft overlong penalty (≤ 0) for each response length, times ``factor``; same shape as ``lengths``.

    ``max_len`` is the maximum response length (rollout.sampling.max_new_tokens), ``cache_len`` the punishment window
    (algo.overlong_cache), ``factor`` algo.overlong_penalty_factor. Computed in float64, returned in ``dtype``.
    """
    if cache_len <= 0:
        raise ValueError(f"cache_len = {cache_len}: must be > 0 (config key algo.overlong_cache)")
    if cache_len > max_len:
        raise ValueError(
            f"cache_len = {cache_len} exceeds max_len = {max_len} "
            "(config keys algo.overlong_cache, rollout.sampling.max_new_tokens)"
        )
    lengths = torch.as_tensor(lengths)
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise TypeError(f"lengths has dtype {lengths.dtype}; expected integer token counts")
    length = lengths.to(torch.float64)
    expected = max_len - cache_len
    inside = (expected - length) / cache_len
    penalty = torch.where(length <= expected, 0.0, torch.where(length <= max_len, inside, -1.0))
    return (penalty * factor).to(dtype)


def overlong_filter_mask(truncated: torch.Tensor | Sequence[bool]) -> torch.Tensor:
    """Per-sample keep mask for overlong filtering: True (1) = keep, False (0) = the sample was truncated."""
    truncated = torch.as_tensor(truncated)
    if truncated.dtype != torch.bool:
        raise TypeError(f"truncated has dtype {truncated.dtype}; expected bool (True = hit the length limit)")
    return ~truncated


def truncated_from_finish_reasons(finish_reasons: Sequence[str | None]) -> torch.Tensor:
    """``finish_reason == "length"`` per sample (the OpenAI / SGLang / vLLM convention) as a bool tensor."""
    return torch.tensor([reason == "length" for reason in finish_reasons], dtype=torch.bool)
