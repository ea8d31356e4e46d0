"""Pick the reward function per dataset row and score batches, with counters for the metrics log.

    scorer = RewardScorer()
    results = scorer.score_batch(responses, rows)   # rows: DAPO-schema dicts (or objects with the same fields)
    metrics.update(scorer.metrics(reset=True))      # reward/invalid, reward/timeouts, ...

A row names its scorer through ``reward_model.style`` (``"math_verify"`` forces the math-verify backend) or else its
``data_source``, matched by exact name or by prefix before a separator (``"aime-2024"`` -> ``"aime"``,
``"synthetic/add2"`` -> ``"synthetic"``). ``math_dapo``, ``aime*``, ``synthetic*``, ``tool*`` use the DAPO "Answer:" rule;
``math_verify*`` uses math-verify in a process pool. An unknown source is an error that names it.

With ``reward.fn`` set (``RewardScorer.from_config``), the user's function scores every row instead (user_fn.py);
the numbers it returns besides ``score`` are averaged per step as ``reward/<name>``.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_dapo.reward.math_dapo import compute_score
from megatron_dapo.reward.math_verify_backend import ERROR, INVALID, TIMEOUT, MathVerifyPool
from megatron_dapo.reward.timed_pool import DEFAULT_MAX_RSS_MB, DEFAULT_MAX_TASKS
from megatron_dapo.reward.user_fn import UserRewardFn

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
    "tool": DAPO_RULE,  # tools/prepare_data.py --tool-example: tool_arith
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


def row_metadata(row: Any) -> dict:
    """What a user's reward function gets as ``metadata``: the row's data_source, index, source and extra fields."""
    extra = _field(row, "extra")
    meta = dict(extra) if isinstance(extra, Mapping) else {}
    for name in ("data_source", "index", "source"):
        if _field(row, name) is not None:
            meta[name] = _field(row, name)
    return meta


def row_prompt(row: Any) -> str:
    """The rendered prompt (``PromptItem.prompt_text``), else the row's ``prompt`` messages' contents joined."""
    text = _field(row, "prompt_text")
    if text is None:
        prompt = _field(row, "prompt")
        text = "\n\n".join(m.get("content", "") for m in prompt) if isinstance(prompt, list) else (prompt or "")
    return str(text)


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
        user_fn: UserRewardFn | None = None,
        worker_max_tasks: int = DEFAULT_MAX_TASKS,
        worker_max_rss_mb: float = DEFAULT_MAX_RSS_MB,
    ):
        self.user_fn = user_fn
        self.extras: collections.defaultdict = collections.defaultdict(lambda: [0.0, 0])  # name -> [sum, count]
        self.sources = dict(DEFAULT_SOURCES)
        for key, name in {**(sources or {}), **({"<force>": force} if force else {})}.items():
            if name not in SCORERS:
                raise ValueError(f"reward scorer {name!r} for {key!r}: must be one of {', '.join(SCORERS)}")
        self.sources.update(sources or {})
        self.force = force
        self._mv_timeout_s = math_verify_timeout_s
        self._mv_workers = math_verify_workers
        self._worker_limits = {"max_tasks": worker_max_tasks, "max_rss_mb": worker_max_rss_mb}
        self._math_verify: MathVerifyPool | None = None
        self.counters: collections.Counter = collections.Counter()

    @classmethod
    def from_config(cls, reward_cfg: Any) -> RewardScorer:
        """The run's scorer: by data_source, or ``reward.fn`` when set (loaded now: a bad value is a ConfigError)."""
        limits = {"worker_max_tasks": reward_cfg.worker_max_tasks, "worker_max_rss_mb": reward_cfg.worker_max_rss_mb}
        if reward_cfg.fn is None:
            return cls(**limits)  # the limits hold for math-verify's workers too
        fn = UserRewardFn(
            reward_cfg.fn,
            workers=reward_cfg.workers,
            timeout_s=reward_cfg.timeout_s,
            failure_score=reward_cfg.failure_score,
            batched=reward_cfg.batched,
            max_consecutive_failures=reward_cfg.max_consecutive_failures,
            **limits,
        )
        return cls(user_fn=fn)

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
            self._math_verify = MathVerifyPool(
                workers=self._mv_workers, timeout_s=self._mv_timeout_s, **self._worker_limits
            )
        return self._math_verify

    def score(self, response: str, row: Any) -> dict:
        return self.score_batch([response], [row])[0]

    def score_batch(self, responses: Sequence[str], rows: Sequence[Any]) -> list[dict]:
        """One result per response: ``{"score": ±1.0, "acc": bool, "pred": str, "status": str, "scorer": str}``.

        ``status`` is ok / wrong / invalid (no answer found) / timeout / error.
        """
        if len(responses) != len(rows):
            raise ValueError(f"score_batch: {len(responses)} responses but {len(rows)} rows")
        if self.user_fn is not None:
            return self._count(self._score_user(responses, rows))
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
        return self._count(results)  # type: ignore[arg-type]

    def _score_user(self, responses: Sequence[str], rows: Sequence[Any]) -> list[dict]:
        assert self.user_fn is not None
        results = self.user_fn.score_batch(
            [row_prompt(r) for r in rows],
            responses,
            [row_ground_truth(r) for r in rows],
            [row_metadata(r) for r in rows],
        )
        for r in results:
            for name, value in r.pop("extras").items():
                self.extras[name][0] += value
                self.extras[name][1] += 1
            r["status"] = r["status"] if r["status"] != "ok" else ("ok" if r["acc"] else "wrong")
            r["scorer"] = self.user_fn.spec
        return results

    def _count(self, results: list[dict]) -> list[dict]:
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
        for name, (total, count) in self.extras.items():
            out[f"reward/{name}"] = total / count if count else 0.0
        if reset:
            self.counters = collections.Counter()
            self.extras.clear()
        return out

    def close(self) -> None:
        if self.user_fn is not None:
            self.user_fn.close()
        if self._math_verify is not None:
            self._math_verify.close()
            self._math_verify = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
