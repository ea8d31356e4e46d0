"""Off-policy bookkeeping of partial rollout (``loop/schedule.py``): token budgets of resumed samples and the
version lag of a batch's tokens. Pure functions, no engine, no model.

A sample aborted at a step's cut keeps its tokens; resumed next step it may generate only what is left of the
response budget (slime #2260 gave a resumed sample a fresh full budget, so it could grow past max_response):

    remaining_budget(max_new_tokens, generated) = max_new_tokens − generated      (≥ 1 for an unfinished sample)

A token's lag is how many weight versions older than the trainer's (π_old, the proximal policy) the weights it was
sampled from are; lag > 0 tokens are the off-policy ones truncated importance sampling weighs (``algo/loss.py``).
"""

from __future__ import annotations


class BudgetError(ValueError):
    """A sample would exceed rollout.sampling.max_new_tokens in total."""


def remaining_budget(max_new_tokens: int, generated: int) -> int:
    """Tokens a sample with ``generated`` tokens so far may still generate; an unfinished sample has at least one."""
    if generated < 0 or generated >= max_new_tokens:
        raise BudgetError(
            f"a sample with {generated} tokens cannot be resumed under rollout.sampling.max_new_tokens = "
            f"{max_new_tokens} (it has its whole budget: it is finished)"
        )
    return max_new_tokens - generated


def check_total_length(length: int, max_new_tokens: int) -> None:
    """A resumed sample never exceeds the response budget in total."""
    if length > max_new_tokens:
        raise BudgetError(
            f"a resumed sample has {length} response tokens, more than rollout.sampling.max_new_tokens = "
            f"{max_new_tokens}: the engine ignored the remaining budget it was given"
        )


def settle_finish(reason: str, response_ids: list[int], max_new_tokens: int, stops: frozenset[int]) -> str:
    """The finish reason of an aborted request that in fact ended: SGLang runs an aborted request one more decode step
    and reports "abort" even when that step emitted EOS (sglang/srt/managers/scheduler.py:5803, schedule_batch.py:2011
    checks to_finish before stop tokens): it stopped, and a stop beats the length cap as in SGLang's own order
    (schedule_batch.py:2030); aborted on its last budgeted token, it has its whole budget ('length')."""
    if reason != "abort":
        return reason
    if response_ids and response_ids[-1] in stops:
        return "stop"
    if len(response_ids) >= max_new_tokens:
        return "length"
    return reason


def version_lag_stats(token_lags: list[list[int]]) -> dict[str, float]:
    """Over a batch's response tokens (per sample, each token's lag): version_lag_mean / _max, partial_token_frac
    (tokens from older weights than the trainer's), offpolicy_sample_frac (samples with such a token)."""
    flat = [lag for row in token_lags for lag in row]
    if not flat:
        return {
            "version_lag_mean": 0.0,
            "version_lag_max": 0.0,
            "partial_token_frac": 0.0,
            "offpolicy_sample_frac": 0.0,
        }
    return {
        "version_lag_mean": sum(flat) / len(flat),
        "version_lag_max": float(max(flat)),
        "partial_token_frac": sum(lag > 0 for lag in flat) / len(flat),
        "offpolicy_sample_frac": sum(any(lag > 0 for lag in row) for row in token_lags) / len(token_lags),
    }
