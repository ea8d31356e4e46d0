"""The control plane: how the ranks meet while rank 0 alone works (rollout, eval, weight sync). A gloo group with
``rollout.control_timeout_s``, never the default group (on GPU that is NCCL, whose watchdog kills a rank that waits
longer than its timeout inside a collective).

    on_driver(fn, *args)          # fn on rank 0, its result (or error) on every rank
    control_barrier()             # every rank here before any goes on
    seqs, extra = scatter_batch(fn, actor)   # rank 0's batch, each DP rank its share
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_dapo.actor.actor import MegatronActor


_CONTROL: dict = {"group": None, "timeout_s": 6 * 3600.0}


def set_control_timeout(seconds: float) -> None:
    """``rollout.control_timeout_s``: how long the control plane waits; before its first use (every rank)."""
    if _CONTROL["group"] is not None and _CONTROL["timeout_s"] != seconds:
        raise RuntimeError("the control group exists already: set its timeout before the first broadcast")
    _CONTROL["timeout_s"] = float(seconds)


def control_group():
    """A gloo group over every rank, with ``rollout.control_timeout_s``: what the ranks wait on while rank 0 alone
    works (rollout, eval, weight sync). Never the default group: on GPU that is NCCL, whose watchdog kills a rank that
    waits longer than its timeout (10 min) inside a collective, and a CUDA stream held by a pending NCCL op."""
    if _CONTROL["group"] is None:
        _CONTROL["group"] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=_CONTROL["timeout_s"]))
    return _CONTROL["group"]


def broadcast(obj=None):
    """Rank 0's object on every rank, over the control plane (gloo)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]


def control_barrier() -> None:
    """Every rank here before any goes on (the control plane's timeout)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=control_group())


def is_driver() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class DriverError(RuntimeError):
    """Raised on the other ranks when rank 0 failed in work only it does (rollout, eval, weight sync)."""


def on_driver(fn, *args):
    """``fn(*args)`` on rank 0 only; its result on every rank. If it raises, every rank raises: rank 0 the error
    itself, the others a ``DriverError`` with its message, so no rank is left waiting in a collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn(*args)
    outcome = None
    if is_driver():
        try:
            outcome = ("ok", fn(*args))
        except Exception as e:
            broadcast(("error", f"rank 0: {type(e).__name__}: {e}"))
            raise
    kind, value = broadcast(outcome)
    if kind == "error":
        raise DriverError(value)
    return value


_DP: dict = {}


def _dp_groups(actor: MegatronActor) -> tuple[list[int], list]:
    """Every rank's DP rank, and per DP rank d a gloo group of rank 0 and the ranks of d (created once, everywhere)."""
    if not _DP:
        ranks = [d for r in range(dist.get_world_size()) for d, held in enumerate(actor.dp_members) if r in held]
        timeout = datetime.timedelta(seconds=_CONTROL["timeout_s"])
        members = [sorted({0, *held}) for held in actor.dp_members]
        _DP.update(
            ranks=ranks, members=members, groups=[dist.new_group(m, backend="gloo", timeout=timeout) for m in members]
        )
    return _DP["ranks"], _DP["groups"]


def scatter_batch(fn, actor: MegatronActor, one_update: bool = False):
    """``fn()`` on rank 0 -> (sequences, small extra). Every rank gets (the sequences as its DP rank needs them: its
    share whole, the others as stubs, ``actor/shares.py``; extra). One broadcast per DP rank over a gloo group of rank
    0 and that DP rank's ranks, not the whole batch to every rank. An error on rank 0 reaches every rank (DriverError).
    ``one_update``: the sequences are one mini-batch update's (train.stream_updates), not a whole step's."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    from megatron_dapo.actor.shares import dp_shares, share_for

    ranks, groups = _dp_groups(actor)
    made: dict = {}  # rank 0's sequences and DP shares: they go out per DP rank below, not to every rank

    def prepare():
        seqs, extra = fn()
        made.update(seqs=seqs, shares=dp_shares(actor, seqs, one_update))
        return extra

    extra = on_driver(prepare)  # the small extra everywhere; rank 0's error on every rank
    seqs, shares = made.get("seqs"), made.get("shares")
    mine = ranks[dist.get_rank()]
    for d, group in enumerate(groups):
        if _DP["members"][d] == [0] or not (is_driver() or d == mine):
            continue
        box = [share_for(seqs, shares[d]) if is_driver() else None]
        dist.broadcast_object_list(box, src=0, group=group)
        if not is_driver():
            seqs = box[0]
    return seqs, extra
