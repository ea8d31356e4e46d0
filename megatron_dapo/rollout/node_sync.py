"""Per-node weight sync: every engine receives its weights from the trainer ranks of its own node, never another's.

    route = LocalRoute.from_env()                 # dapo launch, colocated: the engine on this rank's GPUs (or None)
    sync = NodeLocalSync(route, make_sync, tp)    # every rank; only the route's poster holds a transport
    metrics = sync.sync(export, version)          # collective: every rank exports, each poster updates its engine

Why: colocated on several nodes, a CUDA IPC handle opens only on the node that made it (torch
``reductions.py:rebuild_cuda_tensor`` → ``cudaIpcOpenMemHandle``), so rank 0 cannot feed the other nodes' engines
(issue 14). As in slime (``update_weight_from_tensor.py``: one gather group per engine, the group's first rank posts)
the export gives every rank the whole model (``export_hf_tensors(dst="all")``: TP all-gather, then each pipeline stage
broadcasts its tensors), and the first rank of each engine's share (``launch/placement.py`` ``SyncRoute.poster``)
updates its own engine through the run's transport (``rollout.weight_sync = tensor``), verified there
(/weights_checker). The outcomes meet on the control plane: an error on any node raises on every rank, naming the
engine and the rank.

Left for the GPU: SGLang TP rank i of an engine reads handle i (``tp_worker.py``: ``serialized_named_tensors[tp_rank]``);
the poster serializes one per TP rank from its own copy (a same-node handle opens on any GPU of the node), where
slime gathers one per GPU from the rank on that GPU to keep the memory on each GPU.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch.distributed as dist

from megatron_dapo.rollout.engine import WeightSyncError

LOCAL_URL_ENV, POSTER_ENV = "DAPO_LOCAL_SERVER_URL", "DAPO_LOCAL_SERVER_POSTER"


@dataclass(frozen=True)
class LocalRoute:
    url: str  # the engine on this rank's GPUs
    poster: bool  # this rank sends that engine its weights (the first rank of the engine's share)
    node: str  # where this rank runs (Slurm's node name), for the report

    @classmethod
    def from_env(cls, env: dict | None = None) -> LocalRoute | None:
        """Set by ``dapo launch`` (``slurm_env.torch_env_from_slurm``) when the servers are colocated; else None."""
        env = os.environ if env is None else env
        if not env.get(LOCAL_URL_ENV):
            return None
        node = env.get("SLURMD_NODENAME") or socket.gethostname()
        poster = env.get(POSTER_ENV, "1" if env.get("LOCAL_RANK", "0") == "0" else "0")  # dapo launch sets it
        return cls(env[LOCAL_URL_ENV], poster == "1", node)


class NodeLocalSync:
    """Every rank takes part in the export; the posters update their own engines; all learn every outcome."""

    def __init__(self, route: LocalRoute, make_sync: Callable[[str], object], group=None):
        """Collective: a poster that cannot set up its transport makes every rank raise, none waits for it."""
        self.route, self.group = route, group
        self.local, error = None, None
        if route.poster:
            try:
                self.local = make_sync(route.url)  # a WeightSync over this node's engine only
            except Exception as e:
                error = f"rank {dist.get_rank()} ({route.node}) -> {route.url}: {type(e).__name__}: {e}"
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
        if any(errors):
            raise WeightSyncError("per-node weight sync cannot start: " + "; ".join(e for e in errors if e))
        self.last_routes: list[dict] = []

    def sync(self, buckets: Iterable[list], version: int) -> dict[str, float]:
        """Send ``buckets`` (every rank's full export) to this rank's engine if it posts; raise on every rank if
        any poster failed. Returns the sync metrics (seconds: the slowest engine; bytes and tensors: per engine)."""
        t0 = time.perf_counter()
        outcome: dict = {"rank": dist.get_rank(), "node": self.route.node, "url": self.route.url}
        outcome["posted"] = self.local is not None
        buckets = iter(buckets)
        try:
            if self.local is None:
                for _ in buckets:  # take part in the gathers and broadcasts
                    pass
            else:
                try:
                    report = self.local.sync(buckets, version)
                    outcome.update(metrics=report.metrics(), verified=report.verified)
                except Exception as e:  # keep the export's collectives aligned, then report
                    outcome["error"] = f"{type(e).__name__}: {e}"
                    for _ in buckets:
                        pass
        except Exception as e:  # the export itself failed here: report it (its peers may fail the same way)
            outcome["error"] = outcome.get("error") or f"export: {type(e).__name__}: {e}"
        outcomes = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(outcomes, outcome, group=self.group)
        failed = [o for o in outcomes if o.get("error")]
        if failed:
            raise WeightSyncError(
                f"per-node weight sync v{version} failed: "
                + "; ".join(f"rank {o['rank']} ({o['node']}) -> {o['url']}: {o['error']}" for o in failed)
            )
        posted = [o for o in outcomes if o["posted"]]
        urls = [o["url"] for o in posted]
        if len(set(urls)) != len(urls):
            raise WeightSyncError(f"per-node weight sync v{version}: an engine was updated twice: {sorted(urls)}")
        self.last_routes = [{k: o[k] for k in ("rank", "node", "url")} for o in posted]
        first = posted[0]["metrics"]
        return {
            "sync/seconds": time.perf_counter() - t0,
            "sync/slowest_engine_seconds": max(o["metrics"]["sync/seconds"] for o in posted),
            "sync/verify_seconds": max(o["metrics"]["sync/verify_seconds"] for o in posted),
            "sync/gb": first["sync/gb"],  # per engine
            "sync/tensors": first["sync/tensors"],
            "sync/version": float(version),
            "sync/engines": float(len(posted)),
        }

    def describe(self) -> str:
        return ", ".join(f"{r['url']} <- rank {r['rank']} ({r['node']})" for r in self.last_routes)

    def close(self) -> None:
        if self.local is not None and hasattr(self.local, "close"):
            self.local.close()
