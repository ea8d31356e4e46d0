"""The rollout side's driver: rank 0 owns the rollout engine and its weight sync, and the other ranks learn its
results; the trainer loop (``loop/trainer.py``) and the evaluation (``loop/evaluate.py``) both use it, neither imports the other's
internals. How the ranks meet meanwhile: ``control.py``.

    driver = RolloutDriver(cfg, arch, tokenizer, run_dir, actor)   # engine + make_weight_sync on rank 0
    driver.sync_weights(actor, version)                            # a collective export, rank 0 sends
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_dapo.config.run_config import DapoConfig
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.engines.registry import engine_spec, lora_adapter_sync
from megatron_dapo.loop.control import broadcast, control_group, is_driver, on_driver, set_control_timeout  # noqa: F401
from megatron_dapo.sync.weight_sync import WeightSync
from megatron_dapo.types import TokenizerInfo

if TYPE_CHECKING:
    from megatron_dapo.actor.actor import MegatronActor


class RolloutDriver:
    """Rank 0 owns the rollout engine and its weight sync; every rank takes part in the (collective) export.

    A server that dies mid-rollout is restarted by the engine, which then calls ``resync``: the current weights go to
    the restarted servers only, through the run's transport, verified, before its requests are re-issued."""

    def __init__(self, cfg: DapoConfig, arch, tokenizer, run_dir: Path, actor: MegatronActor):
        self.cfg, self.arch, self.actor = cfg, arch, actor
        self.engine = self.sync = None
        self.spec = engine_spec(cfg.rollout.engine)
        self.adapters_only = lora_adapter_sync(cfg)  # LoRA: the engine applies the adapters, only they are synced
        model_path = cfg.model.hf_init
        if self.spec.starts_from_hf_dir and not model_path and not cfg.rollout.server_urls:
            from megatron_dapo.bridge.export import save_hf_checkpoint

            model_path = (
                run_dir / f"{self.spec.name}_init"
            )  # a server starts from an HF directory: the actor's initial weights
            save_hf_checkpoint(
                actor.model, arch, model_path, tokenizer, cfg.rollout.bucket_mb << 20, merge_lora=not self.adapters_only
            )  # fmt: skip - collective; LoRA: the base alone
        # colocated on several nodes: each node feeds its own engines (the adapters, megabytes, go from rank 0)
        self.node_sync = None if self.adapters_only else _node_local_sync(cfg)

        def start() -> None:
            if self.node_sync is None:
                check_tensor_sync_reach(cfg)
            self.engine = _make_engine(cfg, arch, tokenizer, run_dir, model_path)
            # per node, rank 0's transport reaches only its own engine (what ``resync`` may restart)
            self.sync = self.node_sync.local if self.node_sync else make_weight_sync(cfg, self.engine)
            self.engine.resync = self.resync

        # The other ranks wait here, on the control plane, not in the first export's collective of the default group
        # (NCCL, parallel.collective_timeout_s, 10 min): rank 0's server start waits up to rollout.server_timeout_s
        # for its health (a 32B load can take longer). An error starting it reaches every rank (DriverError).
        on_driver(start)

    def sync_weights(self, actor: MegatronActor, version: int) -> dict[str, float]:
        from megatron_dapo.bridge.export import export_hf_tensors

        if self.adapters_only:
            from megatron_dapo.bridge.peft import gathered_adapter

            adapter = gathered_adapter(actor.model, self.arch)  # collective; on rank 0, every adapter tensor
            return on_driver(lambda: self.sync.sync([sorted(adapter.items())], version).metrics())
        if self.node_sync is not None:
            # a rank that neither posts nor serializes its GPU's copy for the poster (node_sync.GpuGather) holds one
            # tensor at a time (its GPU is shared with the resumed engine); senders take the poster's buckets
            size = self.cfg.rollout.bucket_mb << 20 if self.node_sync.sends else 1
            buckets = export_hf_tensors(actor.model, self.arch, size, dst="all")
            metrics = self.node_sync.sync(buckets, version)
            if is_driver():
                self.engine.set_weight_version(version)
                print(f"weight sync v{version} per node: {self.node_sync.describe()}", flush=True)
            return metrics
        buckets = export_hf_tensors(actor.model, self.arch, self.cfg.rollout.bucket_mb << 20)
        if self.sync is None:
            for _ in buckets:  # take part in the gathers
                pass
        return on_driver(lambda: self.sync.sync(buckets, version).metrics())

    def resync(self, servers: list) -> None:
        """Rank 0, mid-rollout: send the weights of the engine's current version (the actor's: it trains only after
        the rollout) to ``servers``, just restarted. The export runs on rank 0 alone: the other ranks wait for it in
        a broadcast, so it works where rank 0 holds the whole model (TP = PP = 1, or one process)."""
        from megatron_dapo.bridge.export import export_hf_tensors
        from megatron_dapo.types import RolloutError

        p = self.cfg.parallel
        if self.cfg.rollout.schedule != "sync":
            raise RolloutError(
                f"{[s.url for s in servers]} restarted mid-rollout, but with rollout.schedule = "
                f"{self.cfg.rollout.schedule!r} the trainer is training meanwhile: its weights are not the batch's "
                "version and its ranks are not waiting for an export; stopping (--resume auto continues from the last "
                "checkpoint)"
            )
        if self.node_sync is not None and {s.url for s in servers} - {self.node_sync.route.url}:
            raise RolloutError(
                f"{[s.url for s in servers]} restarted, but weights reach an engine only from its own node's ranks "
                "(per-node sync), which wait for rank 0 mid-rollout: stopping"
            )
        if dist.is_initialized() and dist.get_world_size() > 1 and p.tp * p.pp > 1:
            raise RolloutError(
                f"{[s.url for s in servers]} restarted, but resyncing them mid-rollout needs the export of every "
                f"model-parallel rank (parallel.tp x parallel.pp = {p.tp * p.pp}), which wait for rank 0: stopping"
            )
        if self.adapters_only:  # the base came from disk: the current adapter only
            from megatron_dapo.bridge.peft import adapter_hf_tensors

            buckets = [sorted(adapter_hf_tensors(self.actor.model, self.arch).items())]
        else:
            buckets = export_hf_tensors(self.actor.model, self.arch, self.cfg.rollout.bucket_mb << 20)
        report = self.sync.sync(buckets, self.engine.weight_version, workers=list(servers))
        print(
            f"resynced {', '.join(s.url for s in servers)} to weight version {report.version} "
            f"({report.tensors} tensors, {report.seconds:.1f} s, {report.verified} verified)",
            flush=True,
        )

    def close(self) -> None:
        """Stop the rollout servers this run started (an in-process engine has nothing to stop)."""
        if self.node_sync is not None:
            self.node_sync.close()
        elif hasattr(self.sync, "close"):
            self.sync.close()
        if self.engine is not None:  # rank 0's
            self.engine.shutdown()


def _make_engine(cfg: DapoConfig, arch, tokenizer, run_dir: Path, model_path):
    """The engine ``rollout.engine`` names, made through its registry entry (engines/registry.py)."""
    return engine_spec(cfg.rollout.engine).make(cfg, arch, TokenizerInfo.from_hf(tokenizer), run_dir, model_path)


def _is_this_node(host: str) -> bool:
    """``host`` names an address of this machine: loopback, or one a socket can bind to (only local ones can)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        if addr[0].startswith("127.") or addr[0] == "::1":
            return True
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def check_tensor_sync_reach(cfg: DapoConfig, is_this_node=_is_this_node) -> None:
    """Rank 0 alone sends ``tensor`` syncs: CUDA IPC handles (shared-memory files on a CPU), which open only on the
    node that made them (torch/multiprocessing/reductions.py ``rebuild_cuda_tensor`` -> cudaIpcOpenMemHandle). A
    server URL on another node (torchrun + rollout.server_urls across nodes) is a ConfigError naming what works."""
    from urllib.parse import urlsplit

    r = cfg.rollout
    if r.weight_sync not in engine_spec(r.engine).same_node_syncs:
        return
    away = [u for u in r.server_urls if not is_this_node(urlsplit(u).hostname or "")]
    if away:
        raise ConfigError(
            f"rollout.weight_sync = 'tensor' with rollout.server_urls {away} not on this node "
            f"({socket.gethostname()}): rank 0 sends CUDA IPC handles, which open only on their own node; launch with "
            "`dapo launch` (colocated: each node's ranks sync their own node's servers), or use "
            "rollout.weight_sync=distributed (or disk) for servers on other nodes"
        )


def _node_local_sync(cfg: DapoConfig):
    """A ``NodeLocalSync`` on every rank when ``dapo launch`` placed the servers on the ranks' nodes (colocated) and the
    transport is same-node only (``tensor``: CUDA IPC / shared memory); None otherwise, on every rank."""
    from megatron_dapo.sync.per_node import LocalRoute, NodeLocalSync

    spec = engine_spec(cfg.rollout.engine)
    route = LocalRoute.from_env() if cfg.rollout.weight_sync in spec.same_node_syncs else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        routes = [None] * dist.get_world_size()
        dist.all_gather_object(routes, route, group=control_group())
        if any(r is None for r in routes) != all(r is None for r in routes):
            missing = [i for i, r in enumerate(routes) if r is None]
            raise ConfigError(
                f"DAPO_LOCAL_SERVER_URL is set on some ranks only (not on {missing}): launch with dapo "
                "launch, which sets it on every rank of a colocated job"
            )
        if not any(r is not None and r.poster for r in routes):
            route = None
    elif route is not None and not route.poster:
        route = None
    if route is None:
        return None

    def transport(url: str) -> WeightSync:  # over an engine attached to this node's server (it never generates)
        return make_weight_sync(cfg, spec.attach(cfg, url))

    return NodeLocalSync(route, transport, control_group())


def make_weight_sync(cfg: Any, engine: Any) -> WeightSync:
    """The transport named by ``cfg.rollout.weight_sync`` for ``engine``, verifying per ``rollout.verify_sync``; the
    LoRA adapters alone where the engine applies them (``lora_adapter_sync``)."""
    r = cfg.rollout
    spec = engine_spec(r.engine)
    if lora_adapter_sync(cfg):
        return spec.adapter_sync(cfg, engine)
    if r.weight_sync not in spec.weight_syncs:
        raise ConfigError(
            f"rollout.weight_sync = {r.weight_sync!r}: rollout.engine {spec.name!r} takes {', '.join(spec.weight_syncs)}"
        )
    return spec.weight_sync(cfg, engine, r.weight_sync)
