"""Pick the reward function per dataset row and score batches, with counters for the metrics log.

    scorer = RewardScorer()
    results = scorer.score_batch(responses, rows)   # rows: DAPO-schema dicts (or objects with the same fields)
    metrics.update(scorer.metrics(reset=True))      # reward/invalid, reward/timeouts, ...

A row names its scorer through ``reward_model.style`` (``"math_verify"`` forces the math-verify backend) or else its
``data_source``, matched by exact name or by prefix before a separator (``"aime-2024"`` -> ``"aime"``,
``"synthetic/add2"`` -> ``"synthetic"``). ``math_dapo``, ``aime*``, ``synthetic*`` use the DAPO "Answer:" rule;
``math_verify*`` uses math-verify in a process pool. An unknown source is an error that names it.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_dapo.reward.math_dapo import compute_score
from megatron_dapo.reward.math_verify_backend import ERROR, INVALID, TIMEOUT, MathVerifyPool

DAPO_RULE = "math_dapo"
MATH_VERIFY = "math_verify"
SCORERS = (DAPO_RULE, MATH_VERIFY)

# data_source (exact, or the part before the first "/", "-", "_" or digit) -> scorer
DEFAULT_SOURCES: dict[str, str] = {
    "math_dapo": DAPO_RULE,
    "dapo": DAPO_RULE,
    "aime": DAPO_RULE,
    "amc": DAPO_RULE,
    "synthetic": DAPO_RULE,
    "math_verify": MATH_VERIFY,
}


def _field(row: Any, name: str) -> Any:
    if isinstance(row, Mapping):
        return row.get(name)
    return getattr(row, name, None)


def row_ground_truth(row: Any) -> str:
    """``reward_model.ground_truth`` of a DAPO row, or a flat ``ground_truth`` field (``PromptItem``)."""
    gt = _field(row, "ground_truth")
    if gt is None:
        reward_model = _field(row, "reward_model")
        gt = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
    if gt is None or str(gt) == "":
        raise ValueError(f"reward: row of data_source {_field(row, 'data_source')!r} has no reward_model.ground_truth")
    return str(gt)


def _row_style(row: Any) -> str | None:
    style = _field(row, "reward_style")
    if style is None:
        reward_model = _field(row, "reward_model")
        style = reward_model.get("style") if isinstance(reward_model, Mapping) else None
    return style


class RewardScorer:
    """Scores responses against rows; see the module docstring.

    ``force``: use this scorer for every row (``"math_dapo"`` or ``"math_verify"``), ignoring data_source.
    ``sources``: extra ``{data_source prefix: scorer}`` entries on top of ``DEFAULT_SOURCES``.
    """

    def __init__(
        self,
        force: str | None = None,
        sources: Mapping[str, str] | None = None,
        math_verify_timeout_s: float = 5.0,
        math_verify_workers: int | None = None,
    ):
        self.sources = dict(DEFAULT_SOURCES)
        for key, name in {**(sources or {}), **({"<force>": force} if force else {})}.items():
            if name not in SCORERS:
                raise ValueError(f"reward scorer {name!r} for {key!r}: must be one of {', '.join(SCORERS)}")
        self.sources.update(sources or {})
        self.force = force
        self._mv_timeout_s = math_verify_timeout_s
        self._mv_workers = math_verify_workers
        self._math_verify: MathVerifyPool | None = None
        self.counters: collections.Counter = collections.Counter()

    def scorer_for(self, row: Any) -> str:
        """The scorer name for a row (see the module docstring); unknown sources raise, naming the data_source."""
        if self.force:
            return self.force
        if _row_style(row) == MATH_VERIFY:
            return MATH_VERIFY
        source = _field(row, "data_source")
        if not isinstance(source, str) or not source:
            raise ValueError(f"reward: row has no data_source (got {source!r}); cannot pick a reward function")
        key = source.lower()
        if key in self.sources:
            return self.sources[key]
        for prefix in sorted(self.sources, key=len, reverse=True):
            if key.startswith(prefix) and (len(key) == len(prefix) or not key[len(prefix)].isalpha()):
                return self.sources[prefix]
        raise ValueError(
            f"reward: unknown data_source {source!r}: no reward function registered for it "
            f"(known prefixes: {', '.join(sorted(self.sources))}; set reward_model.style='math_verify' or register it)"
        )

    @property
    def math_verify(self) -> MathVerifyPool:
        if self._math_verify is None:
            self._math_verify = MathVerifyPool(workers=self._mv_workers, timeout_s=self._mv_timeout_s)
        return self._math_verify

    def score(self, response: str, row: Any) -> dict:
        return self.score_batch([response], [row])[0]

    def score_batch(self, responses: Sequence[str], rows: Sequence[Any]) -> list[dict]:
        """One result per response: ``{"score": ±1.0, "acc": bool, "pred": str, "status": str, "scorer": str}``.

        ``status`` is ok / wrong / invalid (no answer found) / timeout / error.
        """
        if len(responses) != len(rows):
            raise ValueError(f"score_batch: {len(responses)} responses but {len(rows)} rows")
        names = [self.scorer_for(row) for row in rows]
        truths = [row_ground_truth(row) for row in rows]
        results: list[dict | None] = [None] * len(rows)
        mv_index = [i for i, name in enumerate(names) if name == MATH_VERIFY]
        for i, name in enumerate(names):
            if name == DAPO_RULE:
                r = compute_score(responses[i], truths[i])
                status = INVALID if r.pop("invalid") else ("ok" if r["acc"] else "wrong")
                results[i] = {**r, "status": status, "scorer": DAPO_RULE}
        if mv_index:
            mv = self.math_verify.score_batch([responses[i] for i in mv_index], [truths[i] for i in mv_index])
            for i, r in zip(mv_index, mv):
                results[i] = {**r, "scorer": MATH_VERIFY}
        for r in results:
            assert r is not None
            self.counters["scored"] += 1
            self.counters["correct"] += int(r["acc"])
            self.counters["invalid"] += int(r["status"] == INVALID)
            self.counters["timeouts"] += int(r["status"] == TIMEOUT)
            self.counters["errors"] += int(r["status"] == ERROR)
        return results  # type: ignore[return-value]

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """Counters since the last reset: ``reward/{scored,correct,invalid,timeouts,errors}`` + ``invalid_frac``."""
        c = self.counters
        out = {f"reward/{k}": float(c[k]) for k in ("scored", "correct", "invalid", "timeouts", "errors")}
        out["reward/invalid_frac"] = c["invalid"] / c["scored"] if c["scored"] else 0.0
        if self._math_verify is not None:
            out["reward/math_verify_restarts"] = float(self._math_verify.counters["restarts"])
        if reset:
            self.counters = collections.Counter()
        return out

    def close(self) -> None:
        if self._math_verify is not None:
            self._math_verify.close()
            self._math_verify = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
