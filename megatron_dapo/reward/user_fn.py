"""A reward function the user writes, named by ``reward.fn``, run in a ``TimedPool``.

    # my_rewards.py (anywhere on the path, or named by its file: reward.fn=path/to/my_rewards.py:score)
    def score(prompt: str, response: str, ground_truth: str, metadata: dict) -> float | dict:
        return {"score": 1.0 if ground_truth in response else -1.0, "length": len(response)}

It is called with the keywords ``prompt``, ``response``, ``ground_truth`` and ``metadata`` (the row's
``data_source``, ``index``, ``source`` and its extra fields) and returns a number or a dict holding ``score`` and
further numbers, logged per step as ``reward/<name>`` (their mean); an ``acc`` in the dict says the answer is correct
(else: ``score > 0``). A number may be a Python or numpy one or a bool (``True`` is 1.0); NaN and inf are refused. An ``async def`` works as it is. With ``reward.batched`` it gets one call per group with the
keywords ``prompts``, ``responses``, ``ground_truths``, ``metadatas`` (lists) and returns a list.

Each call runs in a worker process (``reward.workers``; 0 = in the trainer's process, without a time limit) with a
time limit (``reward.timeout_s``). A call that raises, times out or returns something else gives its sample
``reward.failure_score``, is counted (``reward/errors``, ``reward/timeouts``) and the first one is logged with the
function's name and the sample: one bad sample never stops a step. ``reward.max_consecutive_failures`` failures in a
row (a function that fails on every sample) stop the run with that message.

The workers contain the function (timed_pool.py): a worker is recycled after ``reward.worker_max_tasks`` calls and
when its memory passes ``reward.worker_max_rss_mb``; the processes a call starts are killed when it ends; a call that
kills its worker (``os._exit``, a segfault) fails only its own sample.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections.abc import Sequence
from typing import Any

from megatron_dapo.config.plugins import load_callable
from megatron_dapo.reward.timed_pool import DEFAULT_MAX_RSS_MB, DEFAULT_MAX_TASKS, ERROR, OK, TIMEOUT, TimedPool

log = logging.getLogger(__name__)
_LOADED: dict[str, Any] = {}  # per process: spec -> function
# the scorer's own counters (RewardScorer.metrics): a returned number may not take their names
RESERVED = ("scored", "correct", "invalid", "timeouts", "errors", "invalid_frac", "math_verify_restarts")


class RewardFunctionError(RuntimeError):
    """The user's reward function failed on every sample of a long enough stretch: the run stops."""


def _function(spec: str):
    if spec not in _LOADED:
        _LOADED[spec] = load_callable(spec, "reward.fn")
    return _LOADED[spec]


def _number(value: Any, what: str) -> float:
    """A finite float from a Python or numpy number or bool (``True`` -> 1.0); anything else, NaN or inf: TypeError."""
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():  # np.float32(1), np.bool_, 0-d array
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{what} = {value!r} ({type(value).__name__}): must be a finite number or a bool")
    number = float(value)
    if not math.isfinite(number):
        raise TypeError(f"{what} = {value!r}: must be a finite number")
    return number


def normalize(out: Any) -> dict:
    """A function's return value as ``{"score": float, "acc": bool, "extras": {name: float}}``; else TypeError."""
    if isinstance(out, dict):
        if "score" not in out:
            raise TypeError(f"returned a dict without 'score' (keys: {sorted(out)})")
        score = _number(out["score"], "score")
        acc = bool(out["acc"]) if "acc" in out else score > 0
        extras = {str(k): _number(v, f"extra {k!r}") for k, v in out.items() if k not in ("score", "acc")}
        if clash := sorted(set(extras) & set(RESERVED)):
            raise TypeError(f"returned {clash}: names the scorer logs itself (reward/<name>); rename them")
        return {"score": score, "acc": acc, "extras": extras}
    score = _number(out, "the returned score")
    return {"score": score, "acc": score > 0, "extras": {}}


def call_user_fn(spec: str, batched: bool, kwargs: dict) -> list[dict]:
    """One call of the function (in a worker process or inline): normalized results, one per sample."""
    out = _function(spec)(**kwargs)
    if inspect.isawaitable(out):
        out = asyncio.run(_awaited(out))
    if not batched:
        return [normalize(out)]
    n = len(kwargs["responses"])
    if not isinstance(out, (list, tuple)) or len(out) != n:
        raise TypeError(f"reward.batched: returned {type(out).__name__} for {n} samples; expected a list of {n}")
    return [normalize(o) for o in out]


async def _awaited(awaitable):
    return await awaitable


class UserRewardFn:
    """The parent side: one call per sample (or per group when batched), failures scored and counted."""

    def __init__(
        self,
        spec: str,
        workers: int = 2,
        timeout_s: float = 30.0,
        failure_score: float = -1.0,
        batched: bool = False,
        max_consecutive_failures: int = 64,
        worker_max_tasks: int = DEFAULT_MAX_TASKS,
        worker_max_rss_mb: float = DEFAULT_MAX_RSS_MB,
    ):
        _function(spec)  # up front in the parent: a bad spec is a ConfigError naming reward.fn
        self.spec, self.batched, self.failure_score = spec, batched, float(failure_score)
        self.max_consecutive_failures = max_consecutive_failures
        self.timeout_s = timeout_s
        self.pool = (
            TimedPool(
                workers,
                timeout_s,
                name=f"reward.fn {spec}",
                max_tasks=worker_max_tasks,
                max_rss_mb=worker_max_rss_mb,
            )
            if workers > 0
            else None
        )
        self.first_failure: str | None = None
        self.consecutive_failures = 0

    def score_batch(
        self, prompts: Sequence[str], responses: Sequence[str], truths: Sequence[str], metadatas: Sequence[dict]
    ) -> list[dict]:
        n = len(responses)
        if self.batched:
            kw = {"prompts": list(prompts), "responses": list(responses), "ground_truths": list(truths)}
            calls = [(self.spec, True, {**kw, "metadatas": [dict(m) for m in metadatas]})]
        else:
            calls = [
                (self.spec, False, {"prompt": p, "response": r, "ground_truth": t, "metadata": dict(m)})
                for p, r, t, m in zip(prompts, responses, truths, metadatas)
            ]
        outcomes = self.pool.run(call_user_fn, calls) if self.pool else [self._inline(*c) for c in calls]
        results: list[dict] = []
        for (status, value), call in zip(outcomes, calls):
            count = n if self.batched else 1
            if status == OK:
                results += [{**r, "status": OK, "pred": ""} for r in value]
                self.consecutive_failures = 0
                continue
            reason = f"timed out after {self.timeout_s:g} s (reward.timeout_s)" if status == TIMEOUT else str(value)
            self._failed(reason, call[2], count)
            fail = {"score": self.failure_score, "acc": False, "extras": {}, "status": status, "pred": reason[:200]}
            results += [dict(fail) for _ in range(count)]
        return results

    def _inline(self, spec: str, batched: bool, kwargs: dict) -> tuple[str, Any]:
        try:
            return OK, call_user_fn(spec, batched, kwargs)
        except Exception as e:  # noqa: BLE001 - scored as a failure, like a worker's error
            return ERROR, f"{type(e).__name__}: {e}"[:500]

    def _failed(self, reason: str, kwargs: dict, count: int) -> None:
        if self.first_failure is None:
            response = kwargs.get("response", (kwargs.get("responses") or [""])[0])
            prompt = kwargs.get("prompt", (kwargs.get("prompts") or [""])[0])
            self.first_failure = (
                f"reward.fn {self.spec!r} failed: {reason}\n  on the sample: prompt {str(prompt)[-200:]!r}, "
                f"response {str(response)[:200]!r}, ground_truth {kwargs.get('ground_truth', kwargs.get('ground_truths'))!r}"
            )
            log.warning(
                "%s\n  (scored reward.failure_score = %g; later failures are only counted)",
                self.first_failure,
                self.failure_score,
            )
        self.consecutive_failures += count
        if self.consecutive_failures >= self.max_consecutive_failures:
            raise RewardFunctionError(
                f"reward.fn {self.spec!r} failed on the last {self.consecutive_failures} samples "
                f"(reward.max_consecutive_failures = {self.max_consecutive_failures}); the first failure:\n"
                f"{self.first_failure}"
            )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
