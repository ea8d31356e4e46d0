"""Dynamic sampling (DAPO, arXiv 2503.14476, §3.2, eq. 11).

A group (one prompt, G responses) whose responses are all correct or all wrong has zero advantages and so no
gradient. DAPO keeps only groups with

    0 < |{o_i : is_equivalent(a, o_i)}| < G

(filtering on CORRECTNESS, not on the shaped reward), and keeps generating batches until B groups are kept; the
surplus of the last batch is dropped, so every step trains on exactly B × G samples.

Trainer loop::

    sampler = DynamicSampler(cfg.train.batch_prompts, cfg.algo.max_gen_batches, enabled=cfg.algo.dynamic_sampling)
    while not sampler.full:
        groups, correct = generate_and_score(cfg.algo.gen_batch_prompts)   # correct: bool [n, G]
        sampler.add(groups, correct)          # raises DynamicSamplingError once the bound is spent
    batch = sampler.take()                    # exactly B groups, in generation order
    log(sampler.stats())
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_STEP_COUNTERS = ("num_gen_batches", "kept", "dropped_all_correct", "dropped_all_wrong", "surplus")
_TOTAL_COUNTERS = ("steps",) + tuple(f"total_{name}" for name in _STEP_COUNTERS)


class DynamicSamplingError(RuntimeError):
    """Too few informative groups within algo.max_gen_batches generation batches."""


def _check_correct(correct: torch.Tensor, name: str = "correct") -> None:
    if not isinstance(correct, torch.Tensor) or correct.dtype != torch.bool:
        kind = correct.dtype if isinstance(correct, torch.Tensor) else type(correct).__name__
        raise TypeError(f"{name} has dtype {kind}; expected a bool tensor (e.g. reward > 0, not the ±1 reward)")
    if correct.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(correct.shape)}; expected [groups, G]")


def keep_groups(correct: torch.Tensor) -> torch.Tensor:
    """``correct`` bool [groups, G] → bool [groups]: True where 0 < #correct < G (mixed outcomes)."""
    _check_correct(correct)
    num_correct = correct.sum(dim=1)
    return (num_correct > 0) & (num_correct < correct.shape[1])


class DynamicSampler:
    """Accumulates informative groups over generation batches until ``batch_groups`` (B) are kept.

    Args:
        batch_groups: B, groups per training step (train.batch_prompts).
        max_gen_batches: generation batches allowed per step (algo.max_gen_batches); ≤ 0 = unbounded.
        enabled: False = pass-through (algo.dynamic_sampling off): every group is kept, so B come from the first
            batch when it holds at least B groups; ``correct`` may then be None.

    Per-step counters (``num_gen_batches``, ``kept``, ``dropped_all_correct``, ``dropped_all_wrong``, ``surplus``)
    describe the step being collected, or the last one after :meth:`take`; they reset at the next :meth:`add`.
    ``steps`` and ``total_*`` accumulate over the run. The buffer of groups is not part of the state: save between
    steps.
    """

    def __init__(self, batch_groups: int, max_gen_batches: int = 0, *, enabled: bool = True) -> None:
        if batch_groups < 1:
            raise ValueError(f"batch_groups = {batch_groups}: must be >= 1 (config key train.batch_prompts)")
        self.batch_groups = int(batch_groups)
        self.max_gen_batches = int(max_gen_batches)
        self.enabled = bool(enabled)
        self._buffer: list[Any] = []
        self._group_size: int | None = None
        self._taken = False
        self._counters = dict.fromkeys(_STEP_COUNTERS + _TOTAL_COUNTERS, 0)

    # -- counters --------------------------------------------------------------------------------------------------
    @property
    def num_gen_batches(self) -> int:
        return self._counters["num_gen_batches"]

    @property
    def kept(self) -> int:
        return self._counters["kept"]

    @property
    def dropped_all_correct(self) -> int:
        return self._counters["dropped_all_correct"]

    @property
    def dropped_all_wrong(self) -> int:
        return self._counters["dropped_all_wrong"]

    @property
    def surplus(self) -> int:
        return self._counters["surplus"]

    def _bump(self, name: str, value: int) -> None:
        self._counters[name] += value
        self._counters[f"total_{name}"] += value

    @property
    def full(self) -> bool:
        """At least B groups are kept."""
        return len(self._buffer) >= self.batch_groups

    @property
    def missing(self) -> int:
        """Groups still needed to reach B (0 when full)."""
        return max(0, self.batch_groups - len(self._buffer))

    @property
    def bounded(self) -> bool:
        return self.max_gen_batches > 0

    # -- collecting ------------------------------------------------------------------------------------------------
    def add(self, groups: Sequence[Any], correct: torch.Tensor | None, batches: int = 1) -> int:
        """Add one generation batch: ``groups`` (opaque, one per prompt) and ``correct`` bool [len(groups), G]
        (``batches``: how many generation batches this adds to the bound's count; 0 for part of one).

        Keeps the groups with mixed correctness (all of them when disabled), in order; returns how many were kept.
        Raises :class:`DynamicSamplingError` when, after this batch, fewer than B groups are kept and the bound
        ``max_gen_batches`` is spent (so no further batch is generated in vain).
        """
        if self._taken:
            self._start_step()
        groups = list(groups)
        if correct is None:
            if self.enabled:
                raise ValueError("correct is None: dynamic sampling needs the bool [groups, G] correctness")
            keep = [True] * len(groups)
        else:
            _check_correct(correct)
            if correct.shape[0] != len(groups):
                raise ValueError(f"correct has {correct.shape[0]} rows but {len(groups)} groups were given")
            if self._group_size is None:
                self._group_size = int(correct.shape[1])
            elif correct.shape[1] != self._group_size:
                raise ValueError(
                    f"correct has G = {correct.shape[1]} responses per group; earlier batches had {self._group_size}"
                )
            if self.enabled:
                num_correct = correct.sum(dim=1)
                keep = keep_groups(correct).tolist()
                self._bump("dropped_all_correct", int((num_correct == correct.shape[1]).sum()))
                self._bump("dropped_all_wrong", int((num_correct == 0).sum()))
            else:
                keep = [True] * len(groups)
        kept = [g for g, k in zip(groups, keep) if k]
        self._buffer.extend(kept)
        self._bump("num_gen_batches", batches)
        self._bump("kept", len(kept))
        if not self.full and self.bounded and self.num_gen_batches >= self.max_gen_batches:
            raise DynamicSamplingError(self._exhausted_message())
        return len(kept)

    def _exhausted_message(self) -> str:
        what = (
            f"dropped {self.dropped_all_correct} all-correct and {self.dropped_all_wrong} all-wrong groups"
            if self.enabled
            else "dynamic sampling is off"
        )
        return (
            f"dynamic sampling kept {len(self._buffer)} of the {self.batch_groups} groups needed "
            f"(train.batch_prompts) after {self.num_gen_batches} generation batches ({what}); "
            f"raise algo.max_gen_batches (currently {self.max_gen_batches}; <= 0 = unbounded) "
            f"or algo.gen_batch_prompts (prompts per generation batch)"
        )

    def kept_groups(self) -> list[Any]:
        """The groups kept so far this step, in order, at most B (they stay: ``take`` still returns them)."""
        return [] if self._taken else self._buffer[: self.batch_groups]

    def take(self) -> list[Any]:
        """Exactly B groups, in generation order; the surplus is dropped (counted in ``surplus``); ends the step."""
        if not self.full:
            raise DynamicSamplingError(
                f"take() with {len(self._buffer)} of {self.batch_groups} groups kept: call add() until full"
            )
        batch = self._buffer[: self.batch_groups]
        self._bump("surplus", len(self._buffer) - self.batch_groups)
        self._counters["steps"] += 1
        self._buffer = []
        self._taken = True
        return batch

    def _start_step(self) -> None:
        for name in _STEP_COUNTERS:
            self._counters[name] = 0
        self._taken = False

    # -- reporting / resume ----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Counters of the current (or last taken) step and of the run, plus keep_rate = kept / groups seen."""
        out: dict[str, float] = dict(self._counters)
        seen = self.kept + self.dropped_all_correct + self.dropped_all_wrong
        out["keep_rate"] = self.kept / seen if seen else 0.0
        return out

    def state_dict(self) -> dict[str, int]:
        return dict(self._counters)

    def load_state_dict(self, state: dict[str, int]) -> None:
        missing = [k for k in self._counters if k not in state]
        unknown = [k for k in state if k not in self._counters]
        if missing or unknown:
            raise KeyError(f"DynamicSampler state: missing keys {missing}, unknown keys {unknown}")
        self._counters = {k: int(state[k]) for k in self._counters}
        self._buffer = []
        self._taken = True  # a restored state is between steps; the next add() starts a new one


class PromptOrderCollector:
    """One generation batch's groups, finishing in any order, cut in PROMPT order (as verl and NeMo-RL keep them).

    A streaming engine finishes short responses first; keeping groups in the order they finish would drop the long
    and truncated ones — exactly those the overlong penalty and long reasoning need. So the batch is cut at the
    contiguous prefix of prompts (0, 1, 2, …, all finished) that holds the ``needed`` informative groups; the groups
    after the cut, finished or not, are the surplus (abort what still runs once :meth:`add` says done).

    With ``informative_only`` False (dynamic sampling off) every group counts.
    """

    def __init__(self, num_prompts: int, needed: int, informative_only: bool = True) -> None:
        self.num_prompts, self.needed, self.informative_only = num_prompts, needed, informative_only
        self._done: dict[int, tuple[Any, torch.Tensor]] = {}
        self._frontier = 0  # prompts [0, frontier) have all finished
        self._counted = 0  # informative groups among them
        self._cut: int | None = None

    def add(self, prompt_index: int, group: Any, correct: torch.Tensor) -> bool:
        """Record a finished group (``correct`` bool [G]); True once the prompt-order cut is known."""
        if self._cut is not None:
            return True
        self._done[prompt_index] = (group, correct)
        while self._frontier in self._done:
            c = self._done[self._frontier][1]
            self._counted += bool(keep_groups(c[None])[0]) if self.informative_only else 1
            self._frontier += 1
            if self._counted >= self.needed:
                self._cut = self._frontier
                break
        return self._cut is not None

    @property
    def done(self) -> bool:
        return self._cut is not None

    def take(self) -> tuple[list[Any], torch.Tensor | None]:
        """The groups before the cut (all finished ones when no cut), in prompt order, and their correctness."""
        end = self._cut if self._cut is not None else self._frontier
        chosen = [self._done[p] for p in range(end)]
        if not chosen:
            return [], None
        return [g for g, _ in chosen], torch.stack([c for _, c in chosen])
