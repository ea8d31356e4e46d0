"""The DAPO reward rule: the last "Answer: ..." line of the response, Minerva-normalized, compared as a string.

    compute_score("... so the result is 540.\\nAnswer: $540$", "540")  ->  {"score": 1.0, "acc": True, "pred": "540"}

Behaviour follows the public DAPO recipe (verl ``math_dapo.py``, itself after Minerva, Lewkowycz et al. 2022), so
rewards match the paper's setup, quirks included:

* only the last ``ANSWER_WINDOW`` (300) characters of the response are searched;
* the answer is the LAST match of ``Answer\\s*:\\s*([^\\n]+)`` (case-insensitive); no match -> invalid (-1);
* both sides go through :func:`normalize_final_answer`: text after the last ``=``; the substitutions below (including
  the Minerva quirk that drops ``"a "`` / ``"an "`` and all spaces); unit words and LaTeX fragments removed; the first
  ``$...$`` span kept; ``\\text{}``, ``\\textbf{}``, ``\\overline{}``, ``\\boxed{}`` unwrapped; shorthand
  ``\\fracab`` / ``\\sqrta`` expanded; ``$`` removed; thousands commas dropped from all-digit answers;
* exact string equality: ``540.`` and ``0540`` are wrong answers to ``540``.
"""

from __future__ import annotations

import re

ANSWER_WINDOW = 300  # characters at the end of the response that are searched (the longest MATH-500 answer: 159)
INVALID = "[INVALID]"
ANSWER_PATTERN = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)

# Plain-text replacements, applied in order (Minerva appendix; the public DAPO recipe uses the same list).
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Unit words and LaTeX fragments deleted from the answer, in order.
_UNIT_WORDS = (
    "square ways integers dollars mph inches hours km units \\ldots sue points feet minutes digits cents degrees "
    "cm gm pounds meters meals edges students childrentickets multiples"
).split()
_LATEX_FRAGMENTS = (
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
_REMOVED: tuple[str, ...] = (*_UNIT_WORDS, *_LATEX_FRAGMENTS)

_FIRST_MATH_SPAN = re.compile(r"(.*?)(\$)(.*?)(\$)(.*)")  # keep only the first $...$ span
_UNWRAP = (  # (pattern, group to keep); \boxed is greedy so nested braces survive
    re.compile(r"\\text\{(.*?)\}"),
    re.compile(r"\\textbf\{(.*?)\}"),
    re.compile(r"\\overline\{(.*?)\}"),
    re.compile(r"\\boxed\{(.*)\}"),
)
_SHORT_FRAC = re.compile(r"(frac)([^{])(.)")  # \frac12 -> \frac{1}{2}
_SHORT_SQRT = re.compile(r"(sqrt)([^{])")  # \sqrt2 -> \sqrt{2}


def normalize_final_answer(answer: str) -> str:
    """Minerva normalization of a final answer (see the module docstring for the steps)."""
    text = answer.split("=")[-1]
    for old, new in _SUBSTITUTIONS:
        text = text.replace(old, new)
    for fragment in _REMOVED:
        text = text.replace(fragment, "")
    text = _FIRST_MATH_SPAN.sub(r"$\3$", text)
    for pattern in _UNWRAP:
        text = pattern.sub(r"\1", text)
    text = _SHORT_FRAC.sub(r"frac{\2}{\3}", text)
    text = _SHORT_SQRT.sub(r"sqrt{\2}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():  # 1,000 -> 1000
        text = text.replace(",", "")
    return text.strip()


def extract_answer(response: str) -> str | None:
    """The text after the last ``Answer:`` in the last ``ANSWER_WINDOW`` characters, or None."""
    matches = ANSWER_PATTERN.findall(response[-ANSWER_WINDOW:])
    return matches[-1] if matches else None


def compute_score(response: str, ground_truth: str) -> dict:
    """``{"score": +1.0 | -1.0, "acc": bool, "pred": normalized prediction or "[INVALID]", "invalid": bool}``."""
    raw = extract_answer(response)
    if raw is None:
        return {"score": -1.0, "acc": False, "pred": INVALID, "invalid": True}
    pred = normalize_final_answer(raw)
    correct = pred == normalize_final_answer(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred, "invalid": False}
