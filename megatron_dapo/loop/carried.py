"""What partial rollout carries between rounds and steps: a group's samples with their tokens so far and each token's
weight version (``Slot``, ``Carried``), used by the partial schedule (``schedule.py``) and the streaming one
(``stream_schedule.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_dapo.algo.batch import Group
from megatron_dapo.algo.offpolicy import check_total_length, settle_finish


@dataclass
class Slot:
    """One sample of a carried group: what it has generated so far, each token's weight version."""

    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "abort"  # "abort" = unfinished
    text: str = ""
    resumed: int = 0  # times continued after an abort
    routes: Any = None  # the latest segment's routes: they cover the prompt and every token so far (routing replay)
    loss_mask: list[int] | None = None  # a rollout function's (0 = a tool's output)
    calls: list[dict] = field(default_factory=list)  # a rollout function's engine calls so far (ResumingClient)

    @property
    def finished(self) -> bool:
        return self.finish_reason != "abort"


@dataclass
class Carried:
    """A group in flight or finished but not yet judged: its prompt item and G slots."""

    item: Any
    slots: list[Slot]

    @property
    def complete(self) -> bool:
        return all(s.finished for s in self.slots)

    def oldest_version(self) -> int | None:
        firsts = [v for s in self.slots for v in s.versions[:1]]
        firsts += [
            v for s in self.slots for c in s.calls for v in c["versions"][:1]
        ]  # a rollout function's, unfinished
        return min(firsts, default=None)


def extend_slot(slot: Slot, s, version: int, max_new: int, stops: frozenset[int], info) -> None:
    """Append a generated segment ``s`` (sampled on weights ``version``) to ``slot``; ``info`` the engine's tokenizer."""
    if slot.response_ids and s.response_ids:
        slot.resumed += 1
    slot.response_ids += list(s.response_ids)
    slot.logprobs += list(s.logprobs)
    slot.versions += [version] * len(s.response_ids)
    if s.routes is not None:
        slot.routes = s.routes
    slot.finish_reason = settle_finish(s.finish_reason, slot.response_ids, max_new, stops)
    check_total_length(len(slot.response_ids), max_new)
    decode = getattr(info, "decode", None)
    slot.text = info.text(slot.response_ids) if decode is not None else slot.text + s.text


def carried_group(c: Carried, scorer, version: int) -> Group:
    """A complete carried group, scored, its tokens tagged off-policy where older than the trainer's ``version``."""
    results = scorer.score_batch([s.text for s in c.slots], [c.item] * len(c.slots))
    return Group(
        prompt_ids=list(c.item.prompt_ids),
        responses=[list(s.response_ids) for s in c.slots],
        rollout_logprobs=[list(s.logprobs) for s in c.slots],
        finish_reasons=[s.finish_reason for s in c.slots],
        scores=[float(r["score"]) for r in results],
        correct=[bool(r["acc"]) for r in results],
        data_source=c.item.data_source,
        texts=[s.text for s in c.slots],
        token_lag=[[version - v for v in s.versions] for s in c.slots],
        loss_masks=[list(s.loss_mask or [1] * len(s.response_ids)) for s in c.slots]
        if any(s.loss_mask is not None for s in c.slots)
        else [],
        routes=[s.routes for s in c.slots] if any(s.routes is not None for s in c.slots) else [],
    )


def finish_slot(slot: Slot, sample, versions: list[int], max_new: int) -> None:
    """A rollout function's finished sample fills its slot (its output is what is trained; its calls are done)."""
    slot.response_ids, slot.logprobs, slot.versions = list(sample.response_ids), list(sample.logprobs), versions
    slot.loss_mask, slot.text = sample.loss_mask, sample.text
    slot.finish_reason = "length" if sample.finish_reason == "abort" else sample.finish_reason  # it returned
    slot.calls = []
    check_total_length(len(slot.response_ids), max_new)
