"""Rollout routing replay (R3) in the actor: the experts the rollout engine routed each token to, replayed in every
forward of a mixture of experts (the old-logprob pass and every training pass), through megatron-core's own
``RouterReplay`` (transformer/moe/router_replay.py: ``moe_enable_routing_replay``; with ``REPLAY_FORWARD`` each
router takes the given top-k indices and gathers their scores, so the gates still train).

A sequence's routes are [L - 1, MoE layers, top-k] (the last token predicts nothing and is never routed). A micro-batch
lays its sequences out as [B, S] rows; the router of megatron-core sees the hidden states as [S, B, h] flattened
(token (b, s) is row s·B + b), on this stage's MoE layers only, and under sequence parallelism only this TP rank's
slice of S. Positions without a route (the last token of each sequence, padding) take experts 0..k-1: their outputs
reach no loss.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from collections.abc import Sequence as Seq

import torch

from megatron_dapo.actor.gather import all_gather_small
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import ArchConfig
from megatron_dapo.types import Sequence

log = logging.getLogger(__name__)


def stage_moe_layers(arch: ArchConfig, pp: int, stage: int) -> list[int]:
    """Indices into a route tensor's MoE-layer axis of the MoE layers on pipeline stage ``stage``, in layer order."""
    per = arch.num_layers // pp
    moe = [layer for layer in range(arch.num_layers) if arch.is_moe_layer(layer)]
    return [k for k, layer in enumerate(moe) if stage * per <= layer < (stage + 1) * per]


def _fill(n: int, layers: int, topk: int) -> torch.Tensor:
    return torch.arange(topk, dtype=torch.long).expand(n, layers, topk)


def sequence_routes(s: Sequence, layers: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([L, MoE layers, top-k] long, [L] bool routed): the sequence's routes, the last token filled."""
    n = int(s.tokens.numel())
    if s.routes is None:
        raise ValueError("a sequence without routes in a routing-replay micro-batch")
    r = s.routes.long()
    if tuple(r.shape) != (n - 1, layers, topk):
        raise ValueError(
            f"routes of shape {tuple(r.shape)} for a sequence of {n} tokens: expected ({n - 1}, {layers}, {topk})"
        )
    routed = torch.ones(n, dtype=torch.bool)
    routed[-1] = False
    return torch.cat([r, _fill(1, layers, topk)]), routed


def padded_routes(
    seqs: Seq[Sequence], prompt_lens: Seq[int], rows: Seq[Seq[int]], width: int, layers: int, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, S, layers, k], [B, S] routed) for shared-prompt rows (``data/shared_prompt.py``): each row is its first
    sequence's prompt then every sequence's response, right-padded to ``width``."""
    routes = _fill(len(rows) * width, layers, topk).reshape(len(rows), width, layers, topk).clone()
    routed = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        p = prompt_lens[row[0]]
        first, first_routed = sequence_routes(seqs[row[0]], layers, topk)
        routes[b, :p], routed[b, :p] = first[:p], first_routed[:p]
        col = p
        for i in row:
            r, ok = sequence_routes(seqs[i], layers, topk)
            n = r.shape[0] - p
            routes[b, col : col + n], routed[b, col : col + n] = r[p:], ok[p:]
            col += n
    return routes, routed


def packed_routes(
    seqs: Seq[Sequence], offsets: Seq[int], total: int, layers: int, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([1, T, layers, k], [1, T] routed) for packed THD rows: sequence j starts at ``offsets[j]``."""
    routes = _fill(total, layers, topk).clone()
    routed = torch.zeros(total, dtype=torch.bool)
    for s, off in zip(seqs, offsets):
        r, ok = sequence_routes(s, layers, topk)
        routes[off : off + r.shape[0]], routed[off : off + r.shape[0]] = r, ok
    return routes[None], routed[None]


def router_inputs(
    routes: torch.Tensor, local_layers: Seq[int], sp_size: int = 1, sp_rank: int = 0
) -> list[torch.Tensor]:
    """Per MoE layer of this stage, the [S·B (/ TP under sequence parallelism), k] indices its router replays: the
    micro-batch's [B, S, layers, k] routes in megatron-core's [S, B] token order."""
    b, s = routes.shape[:2]
    flat = routes.permute(1, 0, 2, 3).reshape(s * b, *routes.shape[2:])
    if sp_size > 1:
        flat = flat.chunk(sp_size)[sp_rank]
    return [flat[:, k].contiguous() for k in local_layers]


@contextlib.contextmanager
def replaying(
    per_layer: list[torch.Tensor] | None, record: bool = False, keep_for_backward: bool = False
) -> Iterator[None]:
    """Within: every router of this process replays ``per_layer`` (one [tokens, k] tensor per router, in layer order),
    or with ``record`` routes itself and keeps what it chose (``recorded()``). A no-op for ``None``.
    ``keep_for_backward``: the routes stay queued for the recomputed forward of the backward (``replay_in_backward``;
    megatron-core ``RouterReplay.set_target_indices`` appends each micro-batch's routes to ``replay_backward_list``,
    which ``REPLAY_BACKWARD`` pops first in, first out: the micro-batches' backwards run in their forwards' order)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    if per_layer is None and not record:
        yield
        return
    if record:
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    else:
        RouterReplay.set_replay_data(per_layer)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        RouterReplay.clear_global_router_replay_action()
        if not record and not keep_for_backward:
            RouterReplay.clear_global_indices()


def replay_in_backward(output: torch.Tensor) -> None:
    """Switch every router to ``REPLAY_BACKWARD`` when this micro-batch's backward starts (a hook on the model's
    output fires before any layer's gradient, so before any recomputed forward)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    def start(grad: torch.Tensor) -> torch.Tensor:
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        return grad

    if output.requires_grad:
        output.register_hook(start)


def clear_replay() -> None:
    """After a schedule: no action, no routes queued (what a forward-only pass queued no backward pops); what a
    ``record`` forward chose stays for ``recorded()``."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_action()
    for router in RouterReplay.global_router_replay_instances:
        router.target_topk_idx = None
        router.replay_backward_list = []


def recorded() -> list[torch.Tensor]:
    """What each router of this process chose in the last ``replaying(record=True)`` forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    out = RouterReplay.get_recorded_data()
    RouterReplay.clear_global_indices()
    return out


def agreement(chosen: list[torch.Tensor], targets: list[torch.Tensor], routed: torch.Tensor) -> tuple[int, int]:
    """(token × layer top-k sets equal, token × layers compared) over the ``routed`` tokens ([S·B] in router order)."""
    equal = total = 0
    for got, want in zip(chosen, targets):
        got, want = got[routed].sort(-1).values, want.to(got.device)[routed].sort(-1).values
        equal += int((got == want).all(-1).sum())
        total += int(routed.sum())
    return equal, total


@torch.no_grad()
def routing_probe(actor, seqs: list[Sequence]) -> dict[str, float]:
    """On this rank's first micro-batch of ``seqs``: how often this model, routing on its own, picks the engine's
    experts (``routing/agreement``: token × layer top-k sets equal), and the rollout logprob gap with and without
    replay (``routing/logp_gap_replay`` / ``_no_replay``: mean |log π_trainer - log π_rollout| over its response
    tokens). Two forward passes of one micro-batch."""
    for m in actor.model:
        m.eval()
    mbs = actor._micro_batches(seqs)
    mb = mbs[0] if mbs and "router_targets" in mbs[0] else None
    equal = total = 0
    gaps = {False: [0.0, 0], True: [0.0, 0]}  # record (= no replay) -> (sum |gap|, tokens)
    for record in (False, True):
        if mb is None:
            actor._run(mbs[:1], lambda m, model, hidden: (hidden.new_zeros(()), {}), forward_only=True)
            continue
        probe = {
            **mb,
            "probe": True,
            "record_routes": record,
            "router_targets": None if record else mb["router_targets"],
        }

        def loss_fn(m, model, hidden, record=record):
            lp, _ = actor._token_logprobs(m, model, hidden, with_entropy=False)
            gap = (lp.float() - m["sel_rollout_logprobs"].float()).abs()
            gaps[record][0] += float(gap.sum())
            gaps[record][1] += int(gap.numel())
            return hidden.new_zeros(()), {}

        actor._run([probe], loss_fn, forward_only=True)
        if record:
            chosen = recorded()
            equal, total = agreement(chosen, mb["router_targets"], mb["routed"].to(actor.device))
    mine = (equal, total, *gaps[False], *gaps[True]) if actor.tp_rank == 0 else (0, 0, 0.0, 0, 0.0, 0)
    got = all_gather_small(mine, actor.gloo)
    add = [sum(g[k] for g in got) for k in range(6)]
    return {
        "routing/agreement": add[0] / max(1, add[1]),
        "routing/logp_gap_replay": add[2] / max(1, add[3]),
        "routing/logp_gap_no_replay": add[4] / max(1, add[5]),
    }


LOW_AGREEMENT = 0.9  # below it, with replay off, the step warns (Megatron-LM #4168: unreplayed MoE GRPO collapsed)
_warned = [False]


def warn_low_agreement(metrics: dict[str, float]) -> None:
    """Replay off: say once, naming the key, when the trainer routes unlike the engine (``routing/agreement``)."""
    agreement = metrics.get("routing/agreement")
    if agreement is None or agreement >= LOW_AGREEMENT or _warned[0]:
        return
    _warned[0] = True
    log.warning(
        "routing/agreement = %.3f with rollout.routing_replay=false: the trainer routes %.0f%% of token x layer top-k "
        "sets unlike the rollout engine, so the importance ratios compare different experts; set "
        "rollout.routing_replay=true (or null) to replay the engine's routes",
        agreement,
        100 * (1 - agreement),
    )


def clear_instances() -> None:
    """Forget the routers of models built before (megatron-core keeps every router in a class-wide list)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()


def check_replay(cfg) -> None:
    """Settings routing replay cannot work with, named."""
    if cfg.parallel.cp > 1:
        raise ConfigError(
            f"rollout.routing_replay with parallel.cp = {cfg.parallel.cp}: not supported yet (use cp = 1)"
        )
    if cfg.rollout.generate is not None:  # a multi-turn sample's routes are not joined across its turns yet
        raise ConfigError(
            f"rollout.routing_replay with rollout.generate = {cfg.rollout.generate!r}: a rollout function's samples "
            "carry no routes yet; set rollout.routing_replay=false (the trainer routes itself)"
        )


def check_routes(seqs: list[Sequence], cfg) -> None:
    """Replay on but a sample without routes is an error, never a silent fallback to the trainer's own routing."""
    missing = sum(1 for s in seqs if s.routes is None and not getattr(s, "remote", False))
    if missing:
        raise ConfigError(
            f"rollout.routing_replay is on but {missing} of {len(seqs)} samples came back without routes from the "
            f"rollout engine ({cfg.rollout.engine!r}; a rollout function must keep the engine's Sample.routes): "
            "set rollout.routing_replay=false to train with the trainer's own routing"
        )


def moe_aux_losses(arch: ArchConfig, micro_batches: int) -> dict[str, float]:
    """megatron-core's MoE auxiliary losses of the training forwards since the last call (its layer-wise tracker,
    transformer/moe/moe_utils.py ``save_to_aux_losses_tracker``: the load-balancing loss before its coefficient, per
    layer), reduced over PP and DP as its ``reduce_aux_losses_tracker_across_ranks`` does, averaged over the MoE layers
    and micro-batches: ``train/moe_<name>`` (``load_balancing_loss``: 1 = perfectly balanced for the switch loss)."""
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if not tracker or not micro_batches:
        return {}
    moe_utils.reduce_aux_losses_tracker_across_ranks()
    layers = sum(arch.moe_layer_pattern())
    out = {f"train/moe_{name}": float(v["values"].sum()) / layers / micro_batches for name, v in tracker.items()}
    moe_utils.clear_aux_losses_tracker()
    return out
