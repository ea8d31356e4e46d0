"""The Slurm side of a job's tasks: node lists, tasks per node, node addresses, and ``rank-exec`` (SLURM_* ->
torch.distributed's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*). No torch, no config: the trainer's tasks run it first."""

from __future__ import annotations

import json
import os
import re
import subprocess

from megatron_dapo.ports import JobPorts


class LaunchError(RuntimeError):
    """A step failed or could not start; the message names the node, the step and its log file."""


def _split_top_level(spec: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in spec:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def _expand_item(item: str, spec: str) -> list[str]:
    start = item.find("[")
    if start < 0:
        return [item]
    end = item.find("]", start)
    if end < 0:
        raise LaunchError(f"bad Slurm node list {spec!r}: unclosed '['")
    values = []
    for part in item[start + 1 : end].split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise LaunchError(f"bad Slurm node list {spec!r}: range {part!r}")
        values += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi or lo) + 1)]
    return [item[:start] + v + rest for v in values for rest in _expand_item(item[end + 1 :], spec)]


def expand_nodelist(spec: str) -> list[str]:
    """``"n[1-2],gpu[08-10,12]"`` -> ``["n1", "n2", "gpu08", "gpu09", "gpu10", "gpu12"]`` (= scontrol show hostnames)."""
    return [name for item in _split_top_level(spec.strip()) if item for name in _expand_item(item, spec)]


def parse_tasks_per_node(spec: str) -> list[int]:
    """``"8(x2),4"`` (SLURM_TASKS_PER_NODE) -> ``[8, 8, 4]``."""
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise LaunchError(f"cannot parse tasks per node {spec!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _int_env(env: dict, *names: str) -> int | None:
    for name in names:
        m = re.search(r"(\d+)$", env.get(name, "").split(",")[0].split("(")[0])
        if m:
            return int(m.group(1))
    return None


def node_address(node: str) -> str:
    """The address Slurm reaches ``node`` at (``NodeAddr``); the name itself when scontrol cannot tell."""
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return node
    m = re.search(r"\bNodeAddr=(\S+)", out.stdout)
    return m.group(1) if out.returncode == 0 and m else node


def torch_env_from_slurm(env: dict | None = None) -> dict[str, str]:
    """torchrun-style variables for one srun task: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_*;
    plus DAPO_LOCAL_SERVER_URL (the SGLang server on this rank's GPUs) and DAPO_LOCAL_SERVER_POSTER (1: this rank sends
    it the weights) when the launcher placed servers colocated."""
    env = dict(os.environ if env is None else env)
    if "SLURM_PROCID" not in env:
        raise LaunchError("rank-exec must run as an srun task (SLURM_PROCID is not set)")
    node_rank = int(env.get("SLURM_NODEID", "0"))
    per_node = parse_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1")
    out = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS", "1"),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(per_node[min(node_rank, len(per_node) - 1)]),
        "NODE_RANK": str(node_rank),
        "GROUP_RANK": str(node_rank),
    }
    nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost")
    out["MASTER_ADDR"] = env.get("MASTER_ADDR") or node_address(nodes[0])
    ports = JobPorts.from_env(env) or JobPorts.for_job(env.get("SLURM_JOB_ID"))
    out["MASTER_PORT"] = env.get("MASTER_PORT") or str(ports.rendezvous)
    urls = json.loads(env.get("DAPO_SERVER_URLS") or "[]")
    # colocated: the engine on this rank's GPUs (engines in node-major order, DAPO_ENGINES_PER_NODE of them per node,
    # each fed by an equal share of the node's ranks: launch/placement.py), for same-node weight sync (CUDA IPC)
    per_engine = max(1, int(out["LOCAL_WORLD_SIZE"]) // int(env.get("DAPO_ENGINES_PER_NODE") or 1))
    engine = node_rank * int(env.get("DAPO_ENGINES_PER_NODE") or 1) + int(out["LOCAL_RANK"]) // per_engine
    if env.get("DAPO_PLACEMENT") == "colocated" and engine < len(urls):
        out["DAPO_LOCAL_SERVER_URL"] = urls[engine]
        # the first rank of the engine's share posts its weights (placement.SyncRoute.poster; sync/per_node.py)
        out["DAPO_LOCAL_SERVER_POSTER"] = "1" if int(out["LOCAL_RANK"]) % per_engine == 0 else "0"
    return out


def rank_exec(argv: list[str]) -> int:
    """``rank-exec -- CMD...``: set the torch distributed variables from SLURM_* and exec CMD (never returns)."""
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise LaunchError("usage: python -m megatron_dapo.launch.slurm rank-exec -- COMMAND [ARGS...]")
    os.environ.update(torch_env_from_slurm())
    os.execvp(argv[0], argv)
    return 127  # not reached
