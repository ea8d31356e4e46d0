"""Where the rollout engines run and who syncs their weights: a pure function of the cluster and the parallel sizes.

    p = make_placement(nodes=16, gpus_per_node=8, tp=8, pp=2, cp=1, rollout_tp=4)
    print(p.explain())          # engines per node, base GPU ids, the trainer ranks that feed each engine

Colocated (slime's and NeMo-RL's layout): one SGLang server per rollout-TP group of GPUs, ``--dp-size 1`` (SGLang
asserts dp_size == 1 for every weight update, tokenizer_control_mixin.py) with ``--base-gpu-id`` = the group's first
local GPU, ``gpus_per_node / rollout_tp`` engines per node. The trainer process on GPU g of node n is global rank
n·gpus_per_node + g (Slurm's task order with one task per GPU), so each engine's GPUs host trainer ranks of its own
node: those ranks, and only they, send it weights — rank i of the group shares its copy with SGLang TP rank i on the
same GPU (a CUDA IPC handle opens only on its own node), and the group's first rank posts the handles.

Disaggregated: engines fill the last ``rollout_nodes`` nodes; weights go over one NCCL group from trainer rank 0.

Megatron orders ranks tensor-parallel fastest (megatron-core parallel_state ``order="tp-cp-ep-dp-pp"``), so with
PP > 1 an engine's GPUs can host one pipeline stage only: every sending rank must first receive the other stages'
parameters over the trainer's pipeline group (``Placement.pp_exchange``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class PlacementError(ValueError):
    """Sizes that cannot be placed; the message names the setting."""


@dataclass(frozen=True)
class Engine:
    index: int
    node: int  # index into the allocation's node list
    base_gpu_id: int  # local GPU of the engine's TP rank 0 (SGLang --base-gpu-id)
    tp: int

    @property
    def gpus(self) -> range:
        return range(self.base_gpu_id, self.base_gpu_id + self.tp)


@dataclass(frozen=True)
class SyncRoute:
    """Who sends an engine its weights: ``senders[i]`` feeds SGLang TP rank i; ``poster`` gathers and POSTs."""

    engine: int
    node: int
    senders: tuple[int, ...]
    transport: str  # "cuda_ipc" (same node) or "nccl"

    @property
    def poster(self) -> int:
        return self.senders[0]


@dataclass(frozen=True)
class Placement:
    nodes: int
    gpus_per_node: int
    tp: int
    pp: int
    cp: int
    rollout_tp: int
    colocated: bool
    rollout_nodes: int
    engines: tuple[Engine, ...] = field(default=())
    routes: tuple[SyncRoute, ...] = field(default=())
    ranks_per_node: int = 0  # trainer ranks per node; 0 = one per GPU (the colocated contract)

    @property
    def slots(self) -> int:
        return self.ranks_per_node or self.gpus_per_node

    @property
    def engines_per_node(self) -> int:
        return self.gpus_per_node // self.rollout_tp

    @property
    def pp_spans_nodes(self) -> bool:
        """Pipeline stages live on different nodes: the exchange before a sync crosses nodes."""
        return len({self.coords(r)["pp"] for r in range(self.slots)}) < self.pp

    @property
    def train_nodes(self) -> int:
        return self.nodes if self.colocated else self.nodes - self.rollout_nodes

    @property
    def world(self) -> int:
        return self.train_nodes * self.slots

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def pp_exchange(self) -> bool:
        """Sending ranks hold one pipeline stage: they gather the others over the pipeline group before a sync."""
        return self.pp > 1

    def rank(self, node: int, gpu: int) -> int:
        return node * self.slots + gpu

    def node_of(self, rank: int) -> int:
        return rank // self.slots

    def coords(self, rank: int) -> dict[str, int]:
        """Megatron's (tp, cp, dp, pp) ranks of a global rank (tensor fastest, then context, data, pipeline)."""
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp}

    def routes_from(self, rank: int) -> list[SyncRoute]:
        return [r for r in self.routes if rank in r.senders]

    def to_dict(self) -> dict:
        return {
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
            "dp": self.dp,
            "rollout_tp": self.rollout_tp,
            "colocated": self.colocated,
            "engines": [
                {"index": e.index, "node": e.node, "base_gpu_id": e.base_gpu_id, "tp": e.tp} for e in self.engines
            ],
            "routes": [
                {
                    "engine": r.engine,
                    "node": r.node,
                    "senders": list(r.senders),
                    "poster": r.poster,
                    "transport": r.transport,
                }
                for r in self.routes
            ],
            "pp_exchange": self.pp_exchange,
            "pp_spans_nodes": self.pp_spans_nodes,
        }

    def explain(self, node_names: list[str] | None = None) -> str:
        name = (lambda n: node_names[n]) if node_names else (lambda n: f"node{n}")  # noqa: E731
        where = "colocated with training" if self.colocated else f"on the last {self.rollout_nodes} nodes"
        lines = [
            f"trainer: {self.world} ranks = TP{self.tp} × CP{self.cp} × DP{self.dp} × PP{self.pp} on "
            f"{self.train_nodes} nodes × {self.gpus_per_node} GPUs",
            f"rollout: {len(self.engines)} SGLang engines (TP{self.rollout_tp}, dp 1) {where}, "
            f"{self.gpus_per_node // self.rollout_tp} per node",
        ]
        shown = self.routes[: 2 * (self.gpus_per_node // self.rollout_tp)]
        for r in shown:
            e = self.engines[r.engine]
            lines.append(
                f"  engine {e.index} on {name(e.node)} GPUs {e.gpus.start}-{e.gpus.stop - 1} "
                f"(--base-gpu-id {e.base_gpu_id}) <- {r.transport} from trainer ranks {list(r.senders)} "
                f"(rank {r.poster} posts)"
            )
        if len(self.routes) > len(shown):
            lines.append(f"  ... the same on the other nodes ({len(self.routes) - len(shown)} more engines)")
        if self.pp_exchange:
            lines.append("  sending ranks first gather every pipeline stage's parameters over the pipeline group")
        return "\n".join(lines)


def make_placement(
    nodes: int,
    gpus_per_node: int,
    tp: int,
    pp: int,
    cp: int,
    rollout_tp: int,
    colocated: bool = True,
    rollout_nodes: int = 0,
    ranks_per_node: int = 0,
) -> Placement:
    """Engines and sync routes for the cluster (see the module docstring); errors name the setting.

    ``ranks_per_node`` other than the GPU count (CPU runs, emulated nodes) splits a node's ranks evenly over its
    engines; the real colocated contract is one rank per GPU."""
    if gpus_per_node < 1 or nodes < 1:
        raise PlacementError(f"cluster.nodes = {nodes}, cluster.gpus_per_node = {gpus_per_node}: must be >= 1")
    if rollout_tp < 1 or gpus_per_node % rollout_tp:
        raise PlacementError(
            f"rollout.sglang.tp = {rollout_tp}: must divide cluster.gpus_per_node ({gpus_per_node}): an engine's "
            "GPUs are on one node"
        )
    if not colocated and not 0 < rollout_nodes < nodes:
        raise PlacementError(
            f"cluster.rollout_nodes = {rollout_nodes}: disaggregated needs 0 < rollout_nodes < {nodes}"
        )
    train_nodes = nodes if colocated else nodes - rollout_nodes
    slots = ranks_per_node or gpus_per_node
    if slots % (gpus_per_node // rollout_tp):
        raise PlacementError(f"{slots} trainer ranks per node cannot feed {gpus_per_node // rollout_tp} engines evenly")
    world = train_nodes * slots
    if world % (tp * pp * cp):
        raise PlacementError(
            f"parallel.tp × pp × cp = {tp}×{pp}×{cp}: must divide the {world} training GPUs "
            f"({train_nodes} nodes × {gpus_per_node})"
        )
    per_node = gpus_per_node // rollout_tp
    serving = range(nodes) if colocated else range(train_nodes, nodes)
    engines = tuple(
        Engine(k * per_node + j, n, j * rollout_tp, rollout_tp) for k, n in enumerate(serving) for j in range(per_node)
    )
    p = Placement(nodes, gpus_per_node, tp, pp, cp, rollout_tp, colocated, rollout_nodes, engines, (), ranks_per_node)
    if colocated:
        share = slots // per_node  # = rollout_tp with one rank per GPU: the ranks on the engine's GPUs
        routes = tuple(
            SyncRoute(
                e.index,
                e.node,
                tuple(p.rank(e.node, e.base_gpu_id // rollout_tp * share + i) for i in range(share)),
                "cuda_ipc",
            )
            for e in engines
        )
    else:
        routes = tuple(SyncRoute(e.index, e.node, (0,), "nccl") for e in engines)
    return Placement(
        nodes, gpus_per_node, tp, pp, cp, rollout_tp, colocated, rollout_nodes, engines, routes, ranks_per_node
    )
