"""Each data-parallel rank's share of a step's batch: the sequences its micro-batches hold, and for the others only
what the partition reads (lengths, the prompt, the loss mask when not all ones).

    shares = dp_shares(actor, seqs)            # rank 0: per DP rank, the indices its micro-batches use this step
    local = [s if i in shares[d] else stub(s) for i, s in enumerate(seqs)]   # what DP rank d is sent

The actor plans micro-batches from lengths and prompts alone (``MegatronActor.plan_micro_batches``), so every rank
plans the same partition from the stubs; a stub's response never reaches a micro-batch (the actor refuses one). The
share is the union over the step's passes (``step_plan``): the separate π_old pass, then every
mini-batch update, each partitioned over DP on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_dapo.data.packing import split_mini_batches
from megatron_dapo.types import Sequence


@dataclass
class RemoteSequence(Sequence):
    """Another DP rank's sequence: its prompt tokens only, its response length, advantage and (if not all ones) loss
    mask. The actor's gathers leave its ``old_logprobs``/``entropy`` unset: they reach rank 0 and the DP rank that
    trains on a sequence (``actor/gather.py``), never a rank that holds it as a stub."""

    remote_response_len: int = 0
    remote: bool = True

    @property
    def response_len(self) -> int:
        return self.remote_response_len


def stub(s: Sequence, prompts: dict | None = None) -> RemoteSequence:
    """``s`` as another rank sees it; ``prompts`` (tuple of ids -> tensor) makes a group's stubs share one prompt
    tensor, pickled once."""
    prompt = s.tokens[: s.prompt_len]
    if prompts is not None:
        prompt = prompts.setdefault(tuple(prompt.tolist()), prompt.clone())
    mask = s.loss_mask if s.loss_mask is not None and not bool(s.loss_mask.all()) else None
    return RemoteSequence(
        tokens=prompt,
        prompt_len=s.prompt_len,
        advantage=s.advantage,
        old_logprobs=s.old_logprobs,
        rollout_logprobs=None if s.rollout_logprobs is None else torch.empty(0),
        loss_mask=mask,
        remote_response_len=s.response_len,
    )


def step_plan(actor, seqs: list[Sequence]) -> tuple[list[range], bool, list[int]]:
    """(the mini-batches, whether the first takes π_old from its training forward, the indices of the sequences
    whose π_old a separate pass computes first): what ``actor.train_step`` runs."""
    minis = split_mini_batches(len(seqs), actor.cfg.num_updates)
    if actor.cfg.algo.old_logprobs == "rollout":  # π_old is the rollout's: no pass; the first forward's for metrics
        return minis, True, []
    first_from_forward = not actor.cfg.train.recompute_old_logprobs and all(
        seqs[i].old_logprobs is None for i in minis[0]
    )
    missing = [
        i
        for k, rng in enumerate(minis)
        for i in rng
        if seqs[i].old_logprobs is None and not (first_from_forward and k == 0)
    ]
    return minis, first_from_forward, missing


def train_owners(actor, seqs: list[Sequence], minis: list[range], first_from_forward: bool) -> list[int]:
    """Per sequence, the DP rank whose micro-batches train on it in this step (-1: the first mini-batch when it takes
    π_old from its own forward)."""
    owner = [-1] * len(seqs)
    for k, rng in enumerate(minis):
        if not (first_from_forward and k == 0):
            rows, per_rank = actor.plan_micro_batches([seqs[i] for i in rng])
            for d, mbs in enumerate(per_rank):
                for j in (j for mb in mbs for r in mb for j in rows[r]):
                    owner[rng[j]] = d
    return owner


def dp_shares(actor, seqs: list[Sequence], one_update: bool = False) -> list[set[int]]:
    """Per DP rank, the indices of the sequences its micro-batches hold in ``actor.train_step(seqs)`` (``one_update``:
    in one mini-batch update, ``actor.update_mini_batch``: train.stream_updates)."""
    shares: list[set[int]] = [set() for _ in range(actor.dp_size)]
    minis, _, missing = ([range(len(seqs))], False, []) if one_update else actor.step_plan(seqs)
    for idx in [missing, *(list(rng) for rng in minis)]:
        if not idx:
            continue
        rows, per_rank = actor.plan_micro_batches([seqs[i] for i in idx])
        for d, mbs in enumerate(per_rank):
            shares[d].update(idx[i] for mb in mbs for k in mb for i in rows[k])
    return shares


def share_for(seqs: list[Sequence], share: set[int]) -> list[Sequence]:
    prompts: dict = {}
    return [s if i in share else stub(s, prompts) for i, s in enumerate(seqs)]
