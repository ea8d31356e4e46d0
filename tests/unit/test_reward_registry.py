"""Reward dispatch per row (data_source / reward_model.style), batch scoring and its counters."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megatron_dapo.reward.math_dapo import compute_score
from megatron_dapo.reward.registry import DAPO_RULE, MATH_VERIFY, RewardScorer

REPO = Path(__file__).resolve().parents[2]
AIME = REPO / "data" / "aime-2024.parquet"


def _row(source: str, truth: str, style: str = "rule") -> dict:
    return {"data_source": source, "reward_model": {"ground_truth": truth, "style": style}}


@pytest.mark.parametrize(
    "source, style, expected",
    [
        ("math_dapo", "rule-lighteval/MATH_v2", DAPO_RULE),
        ("aime", "rule", DAPO_RULE),
        ("aime-2024", "rule", DAPO_RULE),
        ("AIME24", "rule", DAPO_RULE),
        ("synthetic/add2", "rule", DAPO_RULE),
        ("math_verify", "rule", MATH_VERIFY),
        ("math_dapo", "math_verify", MATH_VERIFY),  # the style overrides the source
    ],
)
def test_scorer_for_row(source: str, style: str, expected: str) -> None:
    assert RewardScorer().scorer_for(_row(source, "1", style)) == expected


def test_unknown_source_names_it() -> None:
    scorer = RewardScorer()
    with pytest.raises(ValueError, match="'gsm8k_custom'"):
        scorer.scorer_for(_row("gsm8k_custom", "1"))
    with pytest.raises(ValueError, match="'aimer'"):  # a prefix must end at a separator
        scorer.scorer_for(_row("aimer", "1"))
    assert RewardScorer(sources={"gsm8k": DAPO_RULE}).scorer_for(_row("gsm8k_custom", "1")) == DAPO_RULE
    with pytest.raises(ValueError, match="'regex'"):
        RewardScorer(sources={"gsm8k": "regex"})


def test_score_batch_on_aime_rows_matches_the_rule() -> None:
    rows = pq.read_table(AIME).slice(0, 64).to_pylist()
    responses = []
    for i, row in enumerate(rows):
        truth = row["reward_model"]["ground_truth"]
        responses.append([f"Answer: {truth}", f"Answer: {truth}1", "no final line", f"Answer: ${truth}$"][i % 4])
    scorer = RewardScorer()
    results = scorer.score_batch(responses, rows)
    expected = [compute_score(r, row["reward_model"]["ground_truth"])["score"] for r, row in zip(responses, rows)]
    assert [r["score"] for r in results] == expected
    assert [r["score"] for r in results[:4]] == [1.0, -1.0, -1.0, 1.0]
    assert all(r["scorer"] == DAPO_RULE for r in results)
    m = scorer.metrics(reset=True)
    assert m["reward/scored"] == 64 and m["reward/correct"] == 32 and m["reward/invalid"] == 16
    assert m["reward/invalid_frac"] == 0.25 and m["reward/timeouts"] == 0
    assert scorer.metrics()["reward/scored"] == 0  # reset


@pytest.mark.timeout(120)
def test_mixed_batch_uses_math_verify_for_its_rows() -> None:
    rows = [_row("math_dapo", "0.5"), _row("math_verify", "\\frac{1}{2}"), _row("math_verify", "5"), _row("aime", "7")]
    responses = ["Answer: 0.5", "so \\boxed{0.5}", "\\boxed{9^{9^{9^{9}}}}", "Answer: 7"]
    with RewardScorer(math_verify_timeout_s=1.0, math_verify_workers=1) as scorer:
        results = scorer.score_batch(responses, rows)
        assert [r["scorer"] for r in results] == [DAPO_RULE, MATH_VERIFY, MATH_VERIFY, DAPO_RULE]
        assert [r["score"] for r in results] == [1.0, 1.0, -1.0, 1.0]
        assert results[2]["status"] == "timeout"
        assert scorer.metrics()["reward/timeouts"] == 1


def test_rows_without_ground_truth_or_mismatched_lengths() -> None:
    scorer = RewardScorer()
    with pytest.raises(ValueError, match="ground_truth"):
        scorer.score_batch(["Answer: 1"], [{"data_source": "aime", "reward_model": {"style": "rule"}}])
    with pytest.raises(ValueError, match="2 responses but 1 rows"):
        scorer.score_batch(["a", "b"], [_row("aime", "1")])
