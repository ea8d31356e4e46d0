"""math-verify as a reward backend, run in a ``TimedPool`` (worker processes, a time limit per call).

    with MathVerifyPool(workers=2, timeout_s=5.0) as pool:
        results = pool.score_batch(["... \\boxed{0.5}"], ["\\frac{1}{2}"])   # [{"score": 1.0, "status": "ok", ...}]

math-verify times itself out with ``signal.alarm``, which only works in a process's main thread, and a stuck C call
ignores signals altogether: its own timeouts are switched off and the pool's limits (timed_pool.py) hold instead, so a
timeout is told apart from a wrong answer. A timed-out or failed call scores -1 and is counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from megatron_dapo.reward.timed_pool import DEFAULT_MAX_RSS_MB, DEFAULT_MAX_TASKS, ERROR, OK, TIMEOUT, TimedPool

WRONG, INVALID = "wrong", "invalid"
NO_ANSWER = "[INVALID]"

# A scorer runs in the worker: (response, ground_truth) -> (correct, pred); correct None = no answer found.
ScoreFn = Callable[[str, str], "tuple[bool | None, str]"]
__all__ = ["ERROR", "INVALID", "NO_ANSWER", "OK", "TIMEOUT", "WRONG", "MathVerifyPool", "math_verify_match"]


def math_verify_match(response: str, ground_truth: str) -> tuple[bool | None, str]:
    """Parse the ground truth (as ``\\boxed{gt}``) and the response with math-verify and compare them symbolically."""
    from math_verify import parse, verify

    gold = parse(ground_truth if "\\boxed" in ground_truth else f"\\boxed{{{ground_truth}}}", parsing_timeout=None)
    if not gold:
        gold = parse(ground_truth, parsing_timeout=None)
    pred = parse(response, parsing_timeout=None)
    if not pred:
        return None, NO_ANSWER
    shown = next((p for p in reversed(pred) if isinstance(p, str)), str(pred[0]))
    return bool(verify(gold, pred, timeout_seconds=None)), shown


def _init_worker() -> None:
    """Worker start: import and exercise math-verify once so the first real call is not charged for it."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # silence "timeout is disabled" (the timer is ours)
    try:
        math_verify_match("\\boxed{1}", "1")
    except Exception:  # noqa: BLE001 - a broken install shows up as errors on the real calls
        pass


def _result(status: str, pred: str) -> dict:
    correct = status == OK
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred, "status": status}


class MathVerifyPool(TimedPool):
    """math-verify in a ``TimedPool``; see the module docstring.

    ``score_fn`` must be a picklable top-level function (tests inject slow ones). Counters (cumulative): those of
    ``TimedPool`` and ``invalid``.
    """

    def __init__(
        self,
        workers: int | None = None,
        timeout_s: float = 5.0,
        grace_s: float | None = None,
        score_fn: ScoreFn = math_verify_match,
        mp_context: str = "spawn",
        startup_timeout_s: float = 300.0,
        max_tasks: int = DEFAULT_MAX_TASKS,
        max_rss_mb: float = DEFAULT_MAX_RSS_MB,
    ):
        super().__init__(
            workers,
            timeout_s,
            grace_s,
            mp_context,
            startup_timeout_s,
            _init_worker,
            "math-verify pool",
            max_tasks=max_tasks,
            max_rss_mb=max_rss_mb,
        )
        self.score_fn = score_fn
        self.counters["invalid"] = 0

    def score(self, response: str, ground_truth: str) -> dict:
        return self.score_batch([response], [ground_truth])[0]

    def score_batch(self, responses: Sequence[str], ground_truths: Sequence[str]) -> list[dict]:
        """Score each response against its ground truth; result dicts carry score (±1), acc, pred, status."""
        if len(responses) != len(ground_truths):
            raise ValueError(f"score_batch: {len(responses)} responses but {len(ground_truths)} ground truths")
        out = []
        for status, value in self.run(self.score_fn, [(r, str(g)) for r, g in zip(responses, ground_truths)]):
            if status == OK:
                correct, pred = value
                status = INVALID if correct is None else (OK if correct else WRONG)
                out.append(_result(status, pred))
            else:
                out.append(_result(status, NO_ANSWER if status == TIMEOUT else str(value)[:200]))
            self.counters["invalid"] += int(out[-1]["status"] == INVALID)
        return out
