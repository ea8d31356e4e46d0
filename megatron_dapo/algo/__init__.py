"""The DAPO algorithm as pure torch functions: no model, no distributed, no I/O."""

from megatron_dapo.algo.advantage import group_advantages, token_advantages
from megatron_dapo.algo.loss import (
    AGG_MODES,
    LOSS_METRIC_REDUCTIONS,
    combine_loss_metrics,
    loss_denominator,
    loss_metrics_from_sums,
    policy_loss,
)
from megatron_dapo.algo.sampling import DynamicSampler, DynamicSamplingError, keep_groups
from megatron_dapo.algo.shaping import overlong_filter_mask, overlong_penalty, truncated_from_finish_reasons

__all__ = [
    "AGG_MODES",
    "LOSS_METRIC_REDUCTIONS",
    "DynamicSampler",
    "DynamicSamplingError",
    "combine_loss_metrics",
    "group_advantages",
    "keep_groups",
    "loss_denominator",
    "loss_metrics_from_sums",
    "overlong_filter_mask",
    "overlong_penalty",
    "policy_loss",
    "token_advantages",
    "truncated_from_finish_reasons",
]
