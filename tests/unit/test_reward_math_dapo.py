"""The DAPO "Answer:" rule: extraction window, last match, Minerva normalization, exact string comparison."""

from __future__ import annotations

import pytest

from megatron_dapo.reward.math_dapo import ANSWER_WINDOW, compute_score, extract_answer, normalize_final_answer

FILLER = "We double-check the computation carefully. "  # 43 characters of other text


@pytest.mark.parametrize(
    "response, ground_truth",
    [
        ("The real part is maximized at 540.\nAnswer: $540$", "540"),
        ("Adding up the parts.\nAnswer: 1,000", "1000"),
        ("The angle sum is\nAnswer: 540 degrees", "540"),
        ("answer: 540", "540"),  # case-insensitive
        ("Answer:540", "540"),
        ("Answer: 12\nOn second thought, that was wrong.\nAnswer: 540", "540"),  # the last match wins
        ("Answer: x = 540", "540"),  # text after the last '='
        ("Answer: \\boxed{540}", "540"),
        ("Answer: \\text{540}", "540"),
        ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}"),
        ("Answer: \\frac12", "\\frac{1}{2}"),  # shorthand \frac expanded
        ("Answer: 540", "$540$"),  # the ground truth is normalized too
        ("Answer: 90^\\circ", "90"),
    ],
)
def test_correct_answers_score_plus_one(response: str, ground_truth: str) -> None:
    r = compute_score(response, ground_truth)
    assert r["score"] == 1.0 and r["acc"] is True, r


@pytest.mark.parametrize(
    "response, ground_truth",
    [
        ("Answer: 540.", "540"),  # a trailing period is not removed
        ("Answer: 0540", "540"),  # string comparison, not numeric
        ("Answer: 541", "540"),
        ("Answer: 540\nAnswer: 12", "540"),  # the LAST match counts
        ("Answer: 1,000", "100"),
    ],
)
def test_wrong_answers_score_minus_one(response: str, ground_truth: str) -> None:
    r = compute_score(response, ground_truth)
    assert r["score"] == -1.0 and r["acc"] is False and r["invalid"] is False, r


def test_no_answer_line_is_invalid() -> None:
    r = compute_score("The answer is \\boxed{540}", "540")
    assert r["score"] == -1.0 and r["acc"] is False and r["invalid"] is True
    assert r["pred"] == "[INVALID]"


def test_answer_outside_last_300_characters_is_not_seen() -> None:
    tail = FILLER * 8  # 344 characters after the answer
    assert len(tail) > 300
    r = compute_score("Answer: 540\n" + tail, "540")
    assert r["score"] == -1.0 and r["invalid"] is True


def test_window_boundary_is_exactly_300_characters() -> None:
    answer = "Answer: 540"
    inside = answer + " " * (ANSWER_WINDOW - len(answer))  # the answer starts at the first character of the window
    assert len(inside) == ANSWER_WINDOW
    assert compute_score("x" * 1000 + inside, "540")["score"] == 1.0
    outside = inside + " "  # now the window starts at "nswer: 540"
    assert compute_score("x" * 1000 + outside, "540")["score"] == -1.0


def test_extract_answer_stops_at_end_of_line() -> None:
    assert extract_answer("Answer: 42\nmore text") == "42"
    assert extract_answer("no answer") is None


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("$540$", "540"),
        ("1,000,000", "1000000"),
        ("1,2", "12"),  # all-digit after comma removal: Minerva drops the commas
        ("(1,2)", "(1,2)"),  # not all digits: commas kept
        ("540 degrees", "540"),
        ("12 cm", "12"),
        ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("x = y = 7", "7"),
        ("\\text{ 5 }", "5"),
        ("5\\;", "5"),
        ("\\sqrt2", "\\sqrt{2}"),
    ],
)
def test_normalize_final_answer(raw: str, expected: str) -> None:
    assert normalize_final_answer(raw) == expected
