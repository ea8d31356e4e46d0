"""Rewards: the DAPO "Answer:" rule (``math_dapo``), math-verify in a process pool, and per-row dispatch."""

from megatron_dapo.reward.math_dapo import compute_score, extract_answer, normalize_final_answer
from megatron_dapo.reward.math_verify_backend import MathVerifyPool, math_verify_match
from megatron_dapo.reward.registry import DAPO_RULE, MATH_VERIFY, RewardScorer, row_ground_truth

__all__ = [
    "DAPO_RULE",
    "MATH_VERIFY",
    "MathVerifyPool",
    "RewardScorer",
    "compute_score",
    "extract_answer",
    "math_verify_match",
    "normalize_final_answer",
    "row_ground_truth",
]
