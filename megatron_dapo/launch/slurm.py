"""Run a DAPO job on a Slurm allocation: roles from SLURM_* variables, SGLang server steps, the trainer step, fail fast.

Inside ``sbatch`` (or ``salloc``) this module is the job's driver, run once on the batch node::

    python -m megatron_dapo.launch.slurm --recipe dapo_32b parallel.tp=8      # = `dapo launch ...`
    python -m megatron_dapo.launch.slurm --recipe dapo_32b --dry-run --nodes 16   # plan only; works anywhere

It builds a :class:`LaunchPlan` (nodes -> roles, TP/PP/CP/DP, commands, environment), starts one SGLang server per
rollout node as a background ``srun --overlap`` job step, polls each server's ``/health``, then starts the trainer step
(``srun`` with one task per GPU, or ``--ntasks-per-node`` tasks on CPU), each task entering through
``rank-exec``, which maps SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID to RANK/WORLD_SIZE/LOCAL_RANK and execs the trainer.
All steps are supervised: if any server exits (at all) or the trainer fails, the others are terminated at once and the
driver exits non-zero naming the node, the step and its log file. Placements: ``colocated`` (every node trains and
serves; servers use ``--enable-memory-saver``) and ``disaggregated`` (the last ``cluster.rollout_nodes`` nodes serve,
the others train; weights go over NCCL). With ``rollout.engine: hf`` (CPU) there are no servers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_dapo.config import ConfigError, DapoConfig, load_config

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class LaunchError(RuntimeError):
    """A step failed or could not start; the message names the node, the step and its log file."""


# ----------------------------------------------------------------------------------------------------------------------
# Slurm environment


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


def default_master_port(base: int, job_id: str | None) -> int:
    """``base`` + (job id mod 1000), so that jobs sharing a node do not collide."""
    return base + (int(job_id) % 1000 if job_id and job_id.isdigit() else 0)


def torch_env_from_slurm(env: dict | None = None) -> dict[str, str]:
    """torchrun-style variables for one srun task: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_*;
    plus DAPO_LOCAL_SERVER_URL (the SGLang server on this rank's node) when the launcher placed servers colocated."""
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
    out["MASTER_PORT"] = env.get("MASTER_PORT") or str(default_master_port(29500, env.get("SLURM_JOB_ID")))
    urls = json.loads(env.get("DAPO_SERVER_URLS") or "[]")
    if env.get("DAPO_PLACEMENT") == "colocated" and node_rank < len(urls):
        out["DAPO_LOCAL_SERVER_URL"] = urls[node_rank]  # for same-node weight sync (CUDA IPC)
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


# ----------------------------------------------------------------------------------------------------------------------
# The plan


@dataclass
class Step:
    """One srun job step: the SGLang server of one node, or the trainer."""

    name: str  # Slurm step name (srun --job-name)
    role: str  # "rollout" | "trainer"
    nodes: list[str]
    ntasks: int
    command: list[str]  # what each task runs
    srun: list[str]  # the full command line
    log: str  # the tasks' output (srun --output; %t = task rank)
    url: str | None = None  # server base URL (health at url + "/health")


@dataclass
class LaunchPlan:
    recipe: str
    model: str
    job_id: str | None
    engine: str
    placement: str  # colocated | disaggregated | cpu
    nodes: list[str]
    train_nodes: list[str]
    rollout_nodes: list[str]
    gpus_per_node: int  # 0 on CPU
    tasks_per_node: int
    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    master_addr: str
    master_port: int
    env: dict[str, str]
    log_dir: str
    health_timeout_s: float
    trainer: Step
    servers: list[Step] = field(default_factory=list)

    def roles(self) -> dict[str, list[str]]:
        return {n: (["train"] if n in self.train_nodes else []) + (["rollout"] if n in self.rollout_nodes else [])
                for n in self.nodes}  # fmt: skip

    def as_dict(self) -> dict:
        return {**asdict(self), "roles": self.roles()}

    def describe(self) -> str:
        gpus = f"{self.gpus_per_node} GPUs each" if self.gpus_per_node else "CPU"
        lines = [
            f"DAPO launch plan: recipe {self.recipe}, model {self.model}, job {self.job_id or '(none: dry run)'}",
            f"placement: {self.placement}; rollout engine: {self.engine}; {len(self.nodes)} nodes, {gpus}",
            f"parallel: TP={self.tp} PP={self.pp} CP={self.cp} DP={self.dp} (world {self.world_size} = "
            f"{len(self.train_nodes)} train nodes x {self.tasks_per_node} ranks)",
            "nodes:",
        ]
        by_node = {s.nodes[0]: s for s in self.servers}
        for i, node in enumerate(self.nodes):
            roles = []
            if node in self.train_nodes:
                k = self.train_nodes.index(node) * self.tasks_per_node
                roles.append(
                    f"train ranks {k}-{k + self.tasks_per_node - 1}" if self.tasks_per_node > 1 else f"train rank {k}"
                )
            if node in by_node:
                roles.append(f"SGLang server {by_node[node].url}")
            head = " (head: MASTER_ADDR)" if node == self.train_nodes[0] else ""
            lines.append(f"  {i:3d} {node}: {' + '.join(roles) or 'idle'}{head}")
        lines.append(f"rollout servers: {len(self.servers)}" + (" (SGLang)" if self.servers else ""))
        lines.append("env: " + " ".join(f"{k}={v}" for k, v in sorted(self.env.items())))
        lines.append("commands:")
        for s in [*self.servers, self.trainer]:
            lines.append(f"  [{s.name}] {shlex.join(s.srun)}")
        lines.append(f"logs: {self.log_dir}/ (one file per step; trainer-<rank>.log)")
        return "\n".join(lines)


@dataclass
class LaunchOptions:
    recipe: str
    overrides: list[str] = field(default_factory=list)
    nodes: int | None = None
    nodelist: str | None = None
    gpus_per_node: int | None = None
    ntasks_per_node: int | None = None
    log_dir: str | None = None
    python: str = sys.executable
    health_timeout_s: float | None = None
    server_cmd: str | None = None  # TESTS/DEBUG ONLY: replaces the SGLang server command (a template)
    trainer_cmd: str | None = None  # TESTS/DEBUG ONLY: replaces `python -m megatron_dapo.cli train ...`


def _fill(template: str, **values: object) -> list[str]:
    return [tok.format(**values) for tok in shlex.split(template)]


def sglang_server_env(cfg: DapoConfig) -> dict[str, str]:
    """The environment of every server task (``srun --export``): T=1 logprobs (the engine's convention), the platform's
    variables and ``rollout.sglang_env``."""
    from megatron_dapo.rollout.sglang_server import PLATFORMS

    env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", **dict(PLATFORMS[cfg.rollout.sglang_device].env)}
    return env | dict(kv.split("=", 1) for kv in cfg.rollout.sglang_env)


def sglang_server_command(cfg: DapoConfig, python: str, port: int, colocated: bool) -> list[str]:
    """One node's ``python -m sglang.launch_server ...`` (its environment: ``sglang_server_env``).

    No ``--dp-size``: SGLang's weight-update endpoints assert dp_size == 1, so a data-parallel server could never be
    synced; the server uses ``rollout.sglang_tp`` GPUs of its node (one engine per TP group: issue 14)."""
    from megatron_dapo.rollout.sglang_server import PLATFORMS, server_args

    r = cfg.rollout
    if not cfg.model.hf_init:
        raise ConfigError("model.hf_init = None: SGLang servers (rollout.engine = 'sglang') need an HF checkpoint dir")
    cmd = [python, "-m", "sglang.launch_server", "--model-path", cfg.model.hf_init, "--host", "0.0.0.0"]
    cmd += ["--port", str(port), "--tp-size", str(r.sglang_tp), "--mem-fraction-static", str(r.mem_fraction)]
    cmd += ["--dtype", _DTYPES[r.dtype or cfg.model.dtype], *PLATFORMS[r.sglang_device].server_args, *server_args(cfg)]
    if colocated:
        cmd.append("--enable-memory-saver")
    return cmd


def build_plan(opts: LaunchOptions, env: dict | None = None, dry_run: bool = False) -> LaunchPlan:
    """Turn the recipe + the allocation (SLURM_* in ``env``) or ``opts.nodes`` into a plan; raise ConfigError."""
    env = dict(os.environ if env is None else env)
    cfg = load_config(opts.recipe, opts.overrides)
    c, r, p = cfg.cluster, cfg.rollout, cfg.parallel
    job_id = env.get("SLURM_JOB_ID")
    if opts.nodelist:
        nodes = expand_nodelist(opts.nodelist)
    elif env.get("SLURM_JOB_NODELIST"):
        nodes = expand_nodelist(env["SLURM_JOB_NODELIST"])
    elif dry_run:
        nodes = [f"node{i + 1}" for i in range(opts.nodes or c.nodes)]
    else:
        raise LaunchError("not inside a Slurm allocation (SLURM_JOB_NODELIST is not set): submit with sbatch, "
                          "run under salloc, or use --dry-run")  # fmt: skip
    if opts.nodes:
        if opts.nodes > len(nodes):
            raise LaunchError(f"--nodes {opts.nodes}: the allocation has only {len(nodes)} nodes ({', '.join(nodes)})")
        nodes = nodes[: opts.nodes]
    gpu = r.engine == "sglang"
    gpus = (
        (opts.gpus_per_node or _int_env(env, "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE") or c.gpus_per_node)
        if gpu
        else 0
    )
    tasks = opts.ntasks_per_node or (gpus if gpu else _int_env(env, "SLURM_NTASKS_PER_NODE") or 1)
    cpus = _int_env(env, "SLURM_CPUS_ON_NODE")

    if not gpu:
        placement, train_nodes, rollout_nodes = "cpu", nodes, []
    elif c.placement == "colocated":
        if not r.colocate:
            raise ConfigError("rollout.colocate = False contradicts cluster.placement = 'colocated'")
        placement, train_nodes, rollout_nodes = "colocated", nodes, nodes
    else:
        if r.colocate:
            raise ConfigError("rollout.colocate = True contradicts cluster.placement = 'disaggregated'")
        if r.weight_sync == "tensor":
            raise ConfigError("rollout.weight_sync = 'tensor' (CUDA IPC) only works on one node: use distributed "
                              "when disaggregated")  # fmt: skip
        if not 0 < c.rollout_nodes < len(nodes):
            raise ConfigError(f"cluster.rollout_nodes = {c.rollout_nodes}: need 0 < rollout_nodes < {len(nodes)} nodes")
        placement, train_nodes, rollout_nodes = "disaggregated", nodes[: -c.rollout_nodes], nodes[-c.rollout_nodes :]
    if r.server_urls:
        rollout_nodes = []  # attach to servers that run elsewhere
    world = len(train_nodes) * tasks
    mp = p.tp * p.pp * p.cp
    if world % mp:
        raise ConfigError(f"parallel.tp x pp x cp = {p.tp}x{p.pp}x{p.cp} = {mp} does not divide the {world} trainer "
                          f"ranks ({len(train_nodes)} nodes x {tasks} ranks)")  # fmt: skip
    if gpu and gpus % r.sglang_tp:
        raise ConfigError(f"rollout.sglang_tp = {r.sglang_tp} must divide the {gpus} GPUs per node")

    addr = {n: node_address(n) if job_id else n for n in nodes}  # scontrol answers only inside a cluster
    master_addr = env.get("MASTER_ADDR") or addr[train_nodes[0]]
    master_port = int(env.get("MASTER_PORT") or default_master_port(c.master_port, job_id))
    log_dir = opts.log_dir or str(Path(cfg.train.run_dir) / cfg.train.name / f"slurm-{job_id or 'dryrun'}")
    py = "python" if c.container_image else opts.python

    def srun(name: str, step_nodes: list[str], ntasks: int, output: str) -> list[str]:
        cmd = ["srun", "--overlap", "--kill-on-bad-exit=1", f"--job-name={name}", f"--output={output}"]
        cmd += [f"--nodes={len(step_nodes)}", f"--ntasks={ntasks}", f"--ntasks-per-node={ntasks // len(step_nodes)}"]
        cmd += [f"--nodelist={','.join(step_nodes)}"]
        if gpu:
            cmd.append(f"--gpus-per-node={gpus}")
        if cpus:
            cmd.append(f"--cpus-per-task={max(1, cpus * len(step_nodes) // ntasks)}")
        if c.container_image:
            cmd += [f"--container-image={c.container_image}", f"--container-workdir={os.getcwd()}"]
            if c.container_mounts:
                cmd.append(f"--container-mounts={','.join(c.container_mounts)}")
        return cmd

    servers, seen_addr = [], {}
    for i, node in enumerate(rollout_nodes):
        port = c.server_port + seen_addr.get(addr[node], 0)  # emulated nodes sharing one address get distinct ports
        seen_addr[addr[node]] = seen_addr.get(addr[node], 0) + 1
        if opts.server_cmd:
            command = _fill(opts.server_cmd, python=py, node=node, port=port, index=i, log_dir=log_dir)
        else:
            command = sglang_server_command(cfg, py, port, placement == "colocated")
        name, log = f"dapo-server-{node}", f"{log_dir}/server-{node}.log"
        export = ",".join(["--export=ALL", *(f"{k}={v}" for k, v in sglang_server_env(cfg).items())])
        servers.append(Step(name, "rollout", [node], 1, command, srun(name, [node], 1, log) + [export] + command, log,
                            f"http://{addr[node]}:{port}"))  # fmt: skip

    urls = [s.url for s in servers] or list(r.server_urls)
    train_args = ["--recipe", opts.recipe, *opts.overrides]
    if servers:
        train_args.append(f"rollout.server_urls={json.dumps(urls, separators=(',', ':'))}")
    if opts.trainer_cmd:
        entry = _fill(opts.trainer_cmd, python=py, server_urls=json.dumps(urls, separators=(",", ":")), log_dir=log_dir)
    else:
        entry = [py, "-m", "megatron_dapo.cli", "train", *train_args]
    command = [py, "-m", "megatron_dapo.launch.slurm", "rank-exec", "--", *entry]
    log = f"{log_dir}/trainer-%t.log"
    trainer = Step("dapo-trainer", "trainer", train_nodes, world, command, srun("dapo-trainer", train_nodes, world, log)
                   + command, log)  # fmt: skip

    run_env = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "PYTHONUNBUFFERED": "1"}
    if urls:  # rank-exec derives DAPO_LOCAL_SERVER_URL (colocated: the server on the rank's own node) from these
        run_env.update(DAPO_SERVER_URLS=json.dumps(urls, separators=(",", ":")), DAPO_PLACEMENT=placement)
    if c.nccl_socket_ifname:
        run_env["NCCL_SOCKET_IFNAME"] = run_env["GLOO_SOCKET_IFNAME"] = c.nccl_socket_ifname
    if c.ib_hca:
        run_env["NCCL_IB_HCA"] = c.ib_hca
    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA"):  # inherited, shown in the plan
        if key in env and key not in run_env:
            run_env[key] = env[key]
    return LaunchPlan(
        recipe=str(opts.recipe), model=cfg.model.arch, job_id=job_id, engine=r.engine, placement=placement,
        nodes=nodes, train_nodes=train_nodes, rollout_nodes=rollout_nodes, gpus_per_node=gpus, tasks_per_node=tasks,
        world_size=world, tp=p.tp, pp=p.pp, cp=p.cp, dp=world // mp, master_addr=master_addr,
        master_port=master_port, env=run_env, log_dir=log_dir,
        health_timeout_s=opts.health_timeout_s or r.server_timeout_s, trainer=trainer, servers=servers,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------------
# Execution: start, wait for health, supervise, tear down


def http_ok(url: str, timeout: float = 30.0) -> bool:
    """GET ``url`` answers 200 within ``timeout`` (SGLang's /health runs a 1-token generation: seconds when busy)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # cluster proxies must not see node URLs
    try:
        with opener.open(url, timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False


def _tail(path: str, n: int = 20) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return f"    ({path}: not written)"
    return "\n".join("    " + line for line in lines) or f"    ({path}: empty)"


class _Terminated(Exception):
    pass


class Supervisor:
    """Runs a plan's steps as child srun processes; any failure tears every other step down at once."""

    def __init__(self, plan: LaunchPlan, poll_s: float = 0.5, grace_s: float = 10.0, out=None):
        self.plan, self.poll_s, self.grace_s = plan, poll_s, grace_s
        self.out = out or sys.stderr
        self.procs: list[tuple[Step, subprocess.Popen, str]] = []

    def say(self, msg: str) -> None:
        print(f"[dapo launch {time.strftime('%H:%M:%S')}] {msg}", file=self.out, flush=True)

    def start(self, step: Step) -> None:
        srun_log = f"{self.plan.log_dir}/{step.name}.srun.log"
        with open(srun_log, "w") as f:
            proc = subprocess.Popen(step.srun, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **self.plan.env}, start_new_session=True)  # fmt: skip
        self.procs.append((step, proc, srun_log))
        self.say(f"started {step.name} on {','.join(step.nodes)} (pid {proc.pid}); log {step.log}")

    def check(self) -> int | None:
        """Raise LaunchError if a step failed (or any server stopped); return the trainer's code when it ended."""
        for step, proc, srun_log in self.procs:
            rc = proc.poll()
            if rc is None or (step.role == "trainer" and rc == 0):
                continue
            if step.role == "rollout":
                raise LaunchError(
                    f"rollout server on node {step.nodes[0]} (step {step.name}) exited with code {rc}"
                    f"; log: {step.log}\n{_tail(step.log)}\n  srun: {srun_log}\n{_tail(srun_log, 5)}"
                )
            # "srun: error: n2: task 1: Exited with exit code 7"; the ranks srun then killed read "Terminated"
            found = re.findall(
                r"srun: error: (\S+): tasks? ([\d,-]+): (.*)", Path(srun_log).read_text(errors="replace")
            )
            found.sort(key=lambda f: "Exited with exit code" not in f[2])
            node, ranks, why = found[0] if found else (",".join(step.nodes), "0", f"srun exited with code {rc}")
            rank_log = step.log.replace("%t", re.split(r"[,-]", ranks)[0])
            raise LaunchError(f"trainer (step {step.name}) failed on node {node}, rank {ranks}: {why} (srun exit "
                              f"code {rc}); log: {rank_log}\n{_tail(rank_log)}\n  srun: {srun_log}\n"
                              f"{_tail(srun_log, 5)}")  # fmt: skip
        done = [proc.returncode for step, proc, _ in self.procs if step.role == "trainer" and proc.returncode == 0]
        return 0 if done else None

    def wait_healthy(self) -> None:
        pending = {s.url for s in self.plan.servers}
        deadline = time.monotonic() + self.plan.health_timeout_s
        while pending:
            self.check()
            for url in sorted(pending):
                if http_ok(url + "/health"):
                    pending.discard(url)
                    self.say(f"server {url} is healthy")
            if pending and time.monotonic() > deadline:
                names = [s.name for s in self.plan.servers if s.url in pending]
                logs = [s.log for s in self.plan.servers if s.url in pending]
                raise LaunchError(f"servers not healthy after {self.plan.health_timeout_s:.0f} s: {', '.join(names)} "
                                  f"({', '.join(sorted(pending))}); logs: {', '.join(logs)}")  # fmt: skip
            time.sleep(self.poll_s if pending else 0)

    def teardown(self) -> None:
        live = [(s, p) for s, p, _ in self.procs if p.poll() is None]
        for step, proc in live:
            self.say(f"stopping {step.name} (pid {proc.pid})")
            proc.send_signal(signal.SIGTERM)  # srun forwards it to the step's tasks
        deadline, killed = time.monotonic() + self.grace_s, set()
        for step, proc in live:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{step.name} did not stop within {self.grace_s:.0f} s: SIGKILL to its srun")
                proc.kill()
                proc.wait()
                killed.add(step.name)
        if killed and self.plan.job_id:
            self._scancel_leftovers(killed)

    def _scancel_leftovers(self, names: set[str]) -> None:
        """Cancel steps of OUR job, with OUR step names, that outlived their srun (only after a SIGKILL)."""
        try:
            out = subprocess.run(["squeue", "-h", "-s", "-j", str(self.plan.job_id), "-o", "%i %j"],
                                 capture_output=True, text=True, timeout=10).stdout  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return
        for line in out.splitlines():
            step_id, _, name = line.strip().partition(" ")
            if name in names and step_id.startswith(f"{self.plan.job_id}."):
                self.say(f"scancel {step_id} ({name})")
                subprocess.run(["scancel", step_id], capture_output=True, timeout=10)

    def run(self) -> int:
        Path(self.plan.log_dir).mkdir(parents=True, exist_ok=True)
        Path(self.plan.log_dir, "plan.json").write_text(json.dumps(self.plan.as_dict(), indent=1))

        def on_signal(signum, _frame):
            raise _Terminated(signal.Signals(signum).name)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for step in self.plan.servers:
                self.start(step)
            if self.plan.servers:
                self.wait_healthy()
            self.start(self.plan.trainer)
            while (rc := self.check()) is None:
                time.sleep(self.poll_s)
            self.say(f"trainer finished; logs in {self.plan.log_dir}")
            return rc
        except LaunchError as e:
            self.say(f"FAILED: {e}")
            return 1
        except _Terminated as e:
            self.say(f"received {e}: stopping all steps")
            return 143
        finally:
            self.teardown()
            for s, handler in old.items():
                signal.signal(s, handler)


# ----------------------------------------------------------------------------------------------------------------------
# Command line


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dapo launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True, help="recipe name (megatron_dapo/recipes) or YAML path")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, passed on to the trainer")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing (works outside Slurm)")
    ap.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    ap.add_argument("--nodes", type=int, help="number of nodes (default: the allocation, or cluster.nodes)")
    ap.add_argument("--nodelist", help="node names, Slurm syntax (default: SLURM_JOB_NODELIST)")
    ap.add_argument("--gpus-per-node", type=int, help="default: SLURM_GPUS_ON_NODE, or cluster.gpus_per_node")
    ap.add_argument("--ntasks-per-node", type=int, help="trainer ranks per node (default: GPUs per node; CPU: 1)")
    ap.add_argument("--log-dir", help="step logs (default: <train.run_dir>/<train.name>/slurm-<job id>)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the steps (default: this one)")
    ap.add_argument(
        "--health-timeout", type=float, help="seconds to wait for servers (default: rollout.server_timeout_s)"
    )
    ap.add_argument("--nemo", action="store_true", help="submit through nemo-run instead (see launch/nemo.py)")
    test = ap.add_argument_group("testing and debugging (replace the real programs)")
    test.add_argument("--server-cmd", help="template for the server command: {python} {node} {port} {index} {log_dir}")
    test.add_argument(
        "--trainer-cmd", help="template for the per-rank trainer command: {python} {server_urls} {log_dir}"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry of `dapo launch ...` and of `python -m megatron_dapo.launch.slurm`; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["rank-exec"]:
            return rank_exec(argv[1:])
        if "--nemo" in argv:
            from megatron_dapo.launch import nemo

            return nemo.main([a for a in argv if a != "--nemo"])
        args = make_parser().parse_intermixed_args(argv)
        opts = LaunchOptions(
            recipe=args.recipe, overrides=args.overrides, nodes=args.nodes, nodelist=args.nodelist,
            gpus_per_node=args.gpus_per_node, ntasks_per_node=args.ntasks_per_node, log_dir=args.log_dir,
            python=args.python, health_timeout_s=args.health_timeout, server_cmd=args.server_cmd,
            trainer_cmd=args.trainer_cmd,
        )  # fmt: skip
        plan = build_plan(opts, dry_run=args.dry_run)
        if args.dry_run:
            print(json.dumps(plan.as_dict(), indent=1) if args.json else plan.describe())
            return 0
        print(plan.describe(), file=sys.stderr, flush=True)
        return Supervisor(plan).run()
    except (ConfigError, LaunchError) as e:
        print(f"dapo launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # run the importable module, not this __main__ copy, so that its exception classes are the ones nemo.py raises
    from megatron_dapo.launch.slurm import main as _main

    sys.exit(_main())
