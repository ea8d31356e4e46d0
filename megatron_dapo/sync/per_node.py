"""Per-node weight sync: every engine receives its weights from the trainer ranks of its own node, never another's.

    route = LocalRoute.from_env()                 # dapo launch, colocated: the engine on this rank's GPUs (or None)
    sync = NodeLocalSync(route, make_sync, tp)    # every rank; only the route's poster holds a transport
    metrics = sync.sync(export, version)          # collective: every rank exports, each poster updates its engine

Why: colocated on several nodes, a CUDA IPC handle opens only on the node that made it (torch
``reductions.py:rebuild_cuda_tensor`` → ``cudaIpcOpenMemHandle``), so rank 0 cannot feed the other nodes' engines.
As in slime (``update_weight_from_tensor.py``: one gather group per engine, the group's first rank posts)
the export gives every rank the whole model (``export_hf_tensors(dst="all")``: TP all-gather, then each pipeline stage
broadcasts its tensors), and the first rank of each engine's share (``launch/placement.py`` ``SyncRoute.poster``)
updates its own engine through the run's transport (``rollout.weight_sync = tensor``), verified there
(/weights_checker). The outcomes meet on the control plane: an error on any node raises on every rank, naming the
engine and the rank.

One serialization per GPU: SGLang TP rank i of an engine reads handle i (``tp_worker.py``:
``serialized_named_tensors[tp_rank]``), and torch opens a CUDA IPC handle on the device that made it
(``reductions.py:rebuild_cuda_tensor``): a handle made by the poster would have TP ranks 1.. make a CUDA context on the
poster's GPU and read across GPUs. So, as slime does (THUDM/slime ``slime/backends/megatron_utils/update_weight/
update_weight_from_tensor.py`` at 624b824: a gloo group per engine of the ranks on its GPUs, lines 159-167; each rank
serializes its own ``FlattenedTensorBucket``, ``dist.gather_object`` to the group's first rank, lines 385-399), when an
engine's TP size equals the number of trainer ranks on its GPUs (one per GPU, the colocated contract) each of them
serializes its own copy and the poster gathers them (``GpuGather``); each keeps its copy alive until the poster has
posted it. Otherwise (TP 1, or CPU emulations with several ranks per device) the poster serializes every TP rank's.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_dapo.types import WeightSyncError

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


class GpuGather:
    """The trainer ranks on one engine's GPUs (``senders[i]`` on TP rank i's GPU, the first posts): one gather per
    bucket, of (bucket key, serialization) or an error, to the poster (slime: ``gather_object`` over a gloo group)."""

    def __init__(self, group: Any, senders: list[int]):
        self.group, self.senders, self.poster = group, list(senders), senders[0]
        self.collected = 0
        self._keep: Any = None

    @property
    def size(self) -> int:
        return len(self.senders)

    def collect(self, item: Any, keep: Any = None) -> list | None:
        """Every sender, once per bucket: the poster gets every sender's ``item`` (in TP-rank order), the others
        None. A sender's previous payload is released here: the poster asks for bucket k+1 only after posting k."""
        out = [None] * self.size if dist.get_rank() == self.poster else None
        dist.gather_object(item, out, dst=self.poster, group=self.group)
        self.collected += 1
        self._keep = keep
        return out

    def blobs(self, items: list, key: str) -> list[str]:
        """The poster: the gathered serializations in TP-rank order; WeightSyncError naming a sender that failed
        or whose bucket differs from the poster's."""
        bad = [
            f"rank {r}: {it if isinstance(it, str) else 'a different bucket (names, shapes, dtypes)'}"
            for r, it in zip(self.senders, items)
            if not isinstance(it, tuple) or it[0] != key
        ]
        if bad:
            raise WeightSyncError(f"per-GPU serializations for TP ranks of {self.senders}: " + "; ".join(bad))
        return [blob for _, blob in items]

    def finish(self) -> None:
        """Every sender, after the last bucket: the poster is done; the last payloads may go."""
        dist.barrier(group=self.group)
        self._keep = None


class _Counted:
    def __init__(self, it: Iterable):
        self.it, self.pulled = iter(it), 0

    def __iter__(self) -> Iterator:
        for x in self.it:
            self.pulled += 1
            yield x


class NodeLocalSync:
    """Every rank takes part in the export; the posters update their own engines; all learn every outcome."""

    def __init__(self, route: LocalRoute, make_sync: Callable[[str], object], group=None):
        """Collective: a poster that cannot set up its transport makes every rank raise, none waits for it."""
        self.route, self.group = route, group
        self.local = self.peer = self.gather = None  # peer: a non-posting sender's transport (serializes only)
        error, tp = None, None
        if route.poster:
            try:
                self.local = make_sync(route.url)  # a WeightSync over this node's engine only
                per_gpu = hasattr(self.local, "gathering")  # a transport that can take per-GPU serializations
                tp = getattr(getattr(self.local, "engine", None), "tp_size", 1) if per_gpu else 1
            except Exception as e:
                error = f"rank {dist.get_rank()} ({route.node}) -> {route.url}: {type(e).__name__}: {e}"
        infos = [None] * dist.get_world_size(group)
        dist.all_gather_object(infos, (route.url, route.poster, tp, error), group=group)
        _raise_errors(infos)
        self._join_gather(infos, make_sync)
        self.last_routes: list[dict] = []

    def _join_gather(self, infos: list, make_sync: Callable[[str], object]) -> None:
        """One gloo group per engine whose TP size is the number of ranks on its GPUs (every rank creates every
        group, in the same order); a non-posting sender makes its own transport to serialize with."""
        rank, error = dist.get_rank(), None
        for url in dict.fromkeys(u for u, *_ in infos):
            senders = [r for r, (u, *_) in enumerate(infos) if u == url]
            tp = next((t for u, poster, t, _ in infos if u == url and poster), 1)
            if not infos[senders[0]][1]:
                raise WeightSyncError(f"per-node weight sync: {url}'s poster must be its first rank {senders}")
            if tp is None or tp < 2 or tp != len(senders):
                continue
            group = dist.new_group(ranks=senders, backend="gloo")  # waits only for the poster's POST and check
            if rank in senders:
                self.gather = GpuGather(group, senders)
        if self.gather is not None and self.local is None:
            try:
                self.peer = make_sync(self.route.url)  # never posts: its serializer and device only
            except Exception as e:
                error = f"rank {rank} ({self.route.node}) -> {self.route.url}: {type(e).__name__}: {e}"
        errors = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(errors, (None, None, None, error), group=self.group)
        _raise_errors(errors)

    @property
    def sends(self) -> bool:
        """This rank serializes the export's buckets (poster or per-GPU sender): it takes them full-size."""
        return self.local is not None or self.peer is not None

    def sync(self, buckets: Iterable[list], version: int) -> dict[str, float]:
        """Send ``buckets`` (every rank's full export) to this rank's engine if it posts; raise on every rank if
        any poster failed. Returns the sync metrics (seconds: the slowest engine; bytes and tensors: per engine)."""
        t0 = time.perf_counter()
        outcome: dict = {"rank": dist.get_rank(), "node": self.route.node, "url": self.route.url}
        outcome["posted"] = self.local is not None
        buckets = _Counted(buckets)
        gather = self.gather
        try:
            if self.peer is not None:  # serialize each bucket for the poster: one gather per bucket
                error = self.peer.send_as_peer(buckets, gather)
                gather.finish()
                if error:
                    outcome["error"] = error
            elif self.local is None:
                for _ in buckets:  # take part in the gathers and broadcasts
                    pass
            else:
                try:
                    with self.local.gathering(gather) if gather else contextlib.nullcontext():
                        report = self.local.sync(buckets, version)
                    outcome.update(metrics=report.metrics(), verified=report.verified)
                except Exception as e:  # keep the export's collectives and the gathers aligned, then report
                    outcome["error"] = f"{type(e).__name__}: {e}"
                    lost = f"rank {dist.get_rank()} (poster) failed"
                    for _ in range(buckets.pulled - gather.collected if gather else 0):
                        gather.collect(lost)  # buckets it took but never gathered
                    for _ in buckets:
                        if gather:
                            gather.collect(lost)
                if gather:
                    gather.finish()
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


def _raise_errors(infos: list) -> None:
    errors = [info[3] for info in infos if info[3]]
    if errors:
        raise WeightSyncError("per-node weight sync cannot start: " + "; ".join(errors))
