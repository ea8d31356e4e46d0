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
serves; servers use ``--enable-memory-saver``, their CUDA graphs included) and ``disaggregated`` (the last
``cluster.rollout_nodes`` nodes serve, the others train; weights go over NCCL). With ``rollout.engine: hf`` (CPU) there
are no servers.

Servers listen on their node's address (the one the ranks use), not on all interfaces, and require the job's API key
(``engines/sglang/auth.py``): the supervisor makes one per job when it starts (or takes $DAPO_SGLANG_API_KEY), writes
it to ``<log dir>/sglang-args.yaml`` (mode 0600, SGLang's ``--config``; removed at the end) and gives it to the trainer
step only, in its environment. The plan, its dry run and every command line name the file, never the key.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_dapo.config.run_config import load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.config.validate import check_world_divides
from megatron_dapo.engines.registry import engine_spec
from megatron_dapo.launch.health import health_timeout_s
from megatron_dapo.launch.layout import (
    check_fits,
    describe_engines,
    describe_memory,
    describe_sync,
    layout_memory,
    memory_dict,
)
from megatron_dapo.launch.placement import PlacementError, make_placement
from megatron_dapo.launch.slurm_env import (  # noqa: F401  (names of this module's API since it began)
    LaunchError,
    _int_env,
    expand_nodelist,
    node_address,
    parse_tasks_per_node,
    rank_exec,
    torch_env_from_slurm,
)
from megatron_dapo.launch.stop import allocation_name, requeue
from megatron_dapo.launch.supervise import Supervisor, http_ok  # noqa: F401  (this module's API since it began)
from megatron_dapo.models.arch import check_divisible, load_arch
from megatron_dapo.ports import JobPorts, find_collisions
from megatron_dapo.runs import EXIT_RESUMABLE, STOP_FILE_ENV

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
    engine: dict | None = None  # a server's engine: index, node, base_gpu_id, tp, port, the trainer ranks feeding it
    # the tasks' own variables, also in srun's environment: Slurm 22.05 keeps a variable srun inherits over the value
    # `--export=ALL,K=V` gives it (a user's PYTHONPATH hid the server's stand-ins)
    env: dict = field(default_factory=dict)


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
    run_dir: str = ""  # checkpoints in run_dir/checkpoints: how far a stopped run got
    steps: int = 0  # train.steps
    stop_file: str = ""  # $DAPO_STOP_FILE of this allocation (launch/stop.py)
    port_base: int = 0  # the job's port block (ports.py)
    layout: dict = field(default_factory=dict)  # GPU: placement.Placement.to_dict() (engines, sync routes)
    memory: dict = field(default_factory=dict)  # GPU: each phase's predicted peak (launch/layout.py)
    layout_text: list[str] = field(default_factory=list)  # the engines, the sync plan, the memory, as describe() shows
    server_args_file: str = ""  # the servers' --config file (the API key, mode 0600), written when the job starts
    # in a container: the one-task step in the image on the first node, up to its interpreter, that runs the GPU
    # stack's preflight there before any server step (launch/preflight.py launch_preflight)
    preflight: list[str] = field(default_factory=list)

    def roles(self) -> dict[str, list[str]]:
        return {
            n: (["train"] if n in self.train_nodes else []) + (["rollout"] if n in self.rollout_nodes else [])
            for n in self.nodes
        }

    def as_dict(self) -> dict:
        return {**asdict(self), "roles": self.roles()}

    def describe(self) -> str:
        gpus = f"{self.gpus_per_node} GPUs each" if self.gpus_per_node else "CPU"
        lines = [
            f"DAPO launch plan: recipe {self.recipe}, model {self.model}, job {self.job_id or '(none: dry run)'}",
            f"code: {Path(__file__).resolve().parents[1]} (run from {os.getcwd()})",
            f"placement: {self.placement}; rollout engine: {self.engine}; {len(self.nodes)} nodes, {gpus}",
            f"parallel: TP={self.tp} PP={self.pp} CP={self.cp} DP={self.dp} (world {self.world_size} = "
            f"{len(self.train_nodes)} train nodes x {self.tasks_per_node} ranks)",
            "nodes:",
        ]
        by_node: dict[str, list[Step]] = {}
        for s in self.servers:
            by_node.setdefault(s.nodes[0], []).append(s)
        for i, node in enumerate(self.nodes):
            roles = []
            if node in self.train_nodes:
                k = self.train_nodes.index(node) * self.tasks_per_node
                roles.append(
                    f"train ranks {k}-{k + self.tasks_per_node - 1}" if self.tasks_per_node > 1 else f"train rank {k}"
                )
            for s in by_node.get(node, []):
                roles.append(f"SGLang server {s.url}")
            head = " (head: MASTER_ADDR)" if node == self.train_nodes[0] else ""
            lines.append(f"  {i:3d} {node}: {' + '.join(roles) or 'idle'}{head}")
        lines.append(f"rollout servers: {len(self.servers)}" + (" (SGLang)" if self.servers else ""))
        lines += self.layout_text
        lines.append("env: " + " ".join(f"{k}={v}" for k, v in sorted(self.env.items())))
        lines.append("commands:")
        if self.preflight:
            lines.append(f"  [dapo-preflight] {shlex.join(self.preflight)} -m megatron_dapo.launch.preflight NEEDS")
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
    resume: str = "auto"  # dapo train --resume: auto | none | a checkpoint directory
    server_cmd: str | None = None  # TESTS/DEBUG ONLY: replaces the SGLang server command (a template)
    trainer_cmd: str | None = None  # TESTS/DEBUG ONLY: replaces `python -m megatron_dapo.cli train ...`


def _fill(template: str, **values: object) -> list[str]:
    return [tok.format(**values) for tok in shlex.split(template)]


def build_plan(opts: LaunchOptions, env: dict | None = None, dry_run: bool = False) -> LaunchPlan:
    """Turn the recipe + the allocation (SLURM_* in ``env``) or ``opts.nodes`` into a plan; raise ConfigError."""
    env = dict(os.environ if env is None else env)
    cfg = load_config(opts.recipe, opts.overrides)
    if cfg.model.hf_init and (Path(cfg.model.hf_init) / "config.json").is_file():  # where the launch node sees it
        from megatron_dapo.models.hf_config import check_hf_dir  # as dapo train does, before any step

        check_hf_dir(load_arch(cfg.model.arch), cfg.model.hf_init)
    c, r, p = cfg.cluster, cfg.rollout, cfg.parallel
    job_id = env.get("SLURM_JOB_ID")
    if opts.nodelist:
        nodes = expand_nodelist(opts.nodelist)
    elif env.get("SLURM_JOB_NODELIST"):
        nodes = expand_nodelist(env["SLURM_JOB_NODELIST"])
    elif dry_run:
        nodes = [f"node{i + 1}" for i in range(opts.nodes or c.nodes)]
    else:
        raise LaunchError(
            "not inside a Slurm allocation (SLURM_JOB_NODELIST is not set): submit with sbatch, "
            "run under salloc, or use --dry-run"
        )
    if opts.nodes:
        if opts.nodes > len(nodes):
            raise LaunchError(f"--nodes {opts.nodes}: the allocation has only {len(nodes)} nodes ({', '.join(nodes)})")
        nodes = nodes[: opts.nodes]
    spec = engine_spec(r.engine)
    gpu = spec.servers  # its servers are job steps on the nodes' GPUs (on a CPU cluster: as many ranks)
    rollout_tp = spec.tp(cfg) if gpu else 1
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
            raise ConfigError(
                "rollout.weight_sync = 'tensor' (CUDA IPC) only works on one node: use distributed when disaggregated"
            )
        if not 0 < c.rollout_nodes < len(nodes):
            raise ConfigError(f"cluster.rollout_nodes = {c.rollout_nodes}: need 0 < rollout_nodes < {len(nodes)} nodes")
        placement, train_nodes, rollout_nodes = "disaggregated", nodes[: -c.rollout_nodes], nodes[-c.rollout_nodes :]
    if r.server_urls:
        rollout_nodes = []  # attach to servers that run elsewhere
    world = len(train_nodes) * tasks
    mp = p.tp * p.pp * p.cp
    check_world_divides(p, world, f"trainer ranks ({len(train_nodes)} nodes x {tasks} ranks)")
    check_divisible(load_arch(cfg.model.arch), p.tp, p.pp, prefix="parallel.")  # before servers spend minutes loading
    if gpu and gpus % rollout_tp:
        raise ConfigError(f"{spec.tp_key} = {rollout_tp} must divide the {gpus} GPUs per node")
    pl, layout = None, None
    if gpu:
        try:
            pl = make_placement(
                len(nodes),
                gpus,
                p.tp,
                p.pp,
                p.cp,
                rollout_tp,
                placement == "colocated",
                len(rollout_nodes) if placement == "disaggregated" else 0,
                0 if tasks == gpus else tasks,
            )
        except PlacementError as e:
            raise ConfigError(str(e)) from e
        if spec.on_gpus(cfg):  # the memory model is a GPU's; refuse before any step starts
            layout = layout_memory(cfg, len(nodes), gpus)
            check_fits(layout, cfg)

    addr = {n: node_address(n) if job_id else n for n in nodes}  # scontrol answers only inside a cluster
    master_addr = env.get("MASTER_ADDR") or addr[train_nodes[0]]
    ports = JobPorts(c.port_base) if c.port_base else JobPorts.for_job(job_id)
    master_port = int(env.get("MASTER_PORT") or c.master_port or ports.rendezvous)
    log_dir = opts.log_dir or str(Path(cfg.train.run_dir) / cfg.train.name / allocation_name(job_id, env))
    py = "python" if c.container_image else opts.python

    def srun(name: str, step_nodes: list[str], ntasks: int, output: str | None) -> list[str]:
        cmd = ["srun", "--overlap", "--kill-on-bad-exit=1", f"--job-name={name}"]
        cmd += [f"--output={output}"] if output else []
        cmd += [f"--nodes={len(step_nodes)}", f"--ntasks={ntasks}", f"--ntasks-per-node={ntasks // len(step_nodes)}"]
        cmd += [f"--nodelist={','.join(step_nodes)}"]
        if gpu:
            cmd.append(f"--gpus-per-node={gpus}")
        if cpus:
            cmd.append(f"--cpus-per-task={max(1, cpus * len(step_nodes) // ntasks)}")
        if c.container_image:  # the driver's directory (nemo-run: the packaged code) is the steps' code, mounted as is
            cwd = os.getcwd()
            mounts = ",".join([*c.container_mounts, f"{cwd}:{cwd}"])
            cmd += [f"--container-image={c.container_image}", f"--container-workdir={cwd}"]
            cmd.append(f"--container-mounts={mounts}")
        return cmd

    servers, seen_addr, port_uses = [], {}, {"rendezvous": (master_addr, master_port)}
    args_file = f"{log_dir}/sglang-args.yaml" if rollout_nodes else ""
    for e in pl.engines if pl and rollout_nodes else ():  # one server per rollout-TP group of GPUs (placement.py)
        node = nodes[e.node]
        k = seen_addr[addr[node]] = seen_addr.get(addr[node], -1) + 1  # the k-th server on its host (address)
        sp = ports.server(k)
        port = c.server_port + k if c.server_port else sp.http
        who = f"server {node} GPU {e.base_gpu_id}"
        port_uses.update({f"{who} (HTTP)": (addr[node], port), who: (addr[node], sp.all()[1:])})
        if opts.server_cmd:
            command = _fill(
                opts.server_cmd,
                python=py,
                node=node,
                port=port,
                index=e.index,
                gpu=e.base_gpu_id,
                log_dir=log_dir,
                args_file=args_file,
            )
        else:
            command = spec.launch_command(
                cfg, py, port, placement == "colocated", addr[node], args_file, e.base_gpu_id, sp.nccl
            )
        tag = node if pl.engines_per_node == 1 else f"{node}-g{e.base_gpu_id}"
        name, log = f"dapo-server-{tag}", f"{log_dir}/server-{tag}.log"
        task_env = spec.launch_env(cfg, placement == "colocated")
        export = ",".join(["--export=ALL", *(f"{k}={v}" for k, v in task_env.items())])
        engine = {
            "index": e.index,
            "node": node,
            "base_gpu_id": e.base_gpu_id,
            "tp": e.tp,
            "port": port,
            "senders": list(pl.routes[e.index].senders),
        }
        servers.append(
            Step(
                name,
                "rollout",
                [node],
                1,
                command,
                srun(name, [node], 1, log) + [export] + command,
                log,
                f"http://{addr[node]}:{port}",
                engine,
                task_env,
            )
        )

    urls = [s.url for s in servers] or list(r.server_urls)
    # options first: dapo train reads the overrides as one positional list (rollout.server_urls is appended below)
    train_args = ["--recipe", opts.recipe, "--resume", opts.resume, *opts.overrides]
    if servers:
        port_uses.update({"router": (master_addr, ports.router), "weight sync": (master_addr, ports.weight_sync)})
    clashes = find_collisions(port_uses)
    if clashes:
        raise LaunchError(f"port plan (block {ports.base}, cluster.port_base/master_port/server_port): {clashes[0]}")
    if servers:
        train_args.append(f"rollout.server_urls={json.dumps(urls, separators=(',', ':'))}")
    if opts.trainer_cmd:
        entry = _fill(
            opts.trainer_cmd,
            python=py,
            server_urls=json.dumps(urls, separators=(",", ":")),
            log_dir=log_dir,
            resume=opts.resume,
        )
    else:
        entry = [py, "-m", "megatron_dapo.cli", "train", *train_args]
    command = [py, "-m", "megatron_dapo.launch.slurm", "rank-exec", "--", *entry]
    log = f"{log_dir}/trainer-%t.log"
    trainer = Step(
        "dapo-trainer",
        "trainer",
        train_nodes,
        world,
        command,
        srun("dapo-trainer", train_nodes, world, log) + command,
        log,
    )

    # the image's GPU stack, checked in the image (one task on the first node) before any server step
    preflight = [*srun("dapo-preflight", nodes[:1], 1, None), py] if c.container_image and gpu else []
    stop_file = f"{log_dir}/stop-request"
    run_env = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "PYTHONUNBUFFERED": "1",
        STOP_FILE_ENV: stop_file,
        **ports.env(),
    }
    if urls:  # rank-exec derives DAPO_LOCAL_SERVER_URL (colocated: the server on the rank's own node) from these
        run_env.update(DAPO_SERVER_URLS=json.dumps(urls, separators=(",", ":")), DAPO_PLACEMENT=placement)
        if servers:  # in engine order: node-major, then base GPU (placement.py)
            run_env["DAPO_ENGINES_PER_NODE"] = str(pl.engines_per_node)
            # named in the trainer's errors about a server (engine restart limit)
            run_env["DAPO_SERVER_LOGS"] = json.dumps({s.url: s.log for s in servers}, separators=(",", ":"))
    layout_text = []
    if pl and servers:
        layout_text = describe_engines(pl, nodes, [s.engine["port"] for s in servers]) + describe_sync(pl, nodes)
    if layout:
        layout_text += describe_memory(layout)
    if c.nccl_socket_ifname:
        run_env["NCCL_SOCKET_IFNAME"] = run_env["GLOO_SOCKET_IFNAME"] = c.nccl_socket_ifname
    if c.ib_hca:
        run_env["NCCL_IB_HCA"] = c.ib_hca
    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA"):  # inherited, shown in the plan
        if key in env and key not in run_env:
            run_env[key] = env[key]
    return LaunchPlan(
        recipe=str(opts.recipe),
        model=cfg.model.arch,
        job_id=job_id,
        engine=r.engine,
        placement=placement,
        nodes=nodes,
        train_nodes=train_nodes,
        rollout_nodes=rollout_nodes,
        gpus_per_node=gpus,
        tasks_per_node=tasks,
        world_size=world,
        tp=p.tp,
        pp=p.pp,
        cp=p.cp,
        dp=world // mp,
        master_addr=master_addr,
        master_port=master_port,
        env=run_env,
        log_dir=log_dir,
        health_timeout_s=opts.health_timeout_s or health_timeout_s(cfg, len(servers)),
        trainer=trainer,
        servers=servers,
        run_dir=str(Path(cfg.train.run_dir) / cfg.train.name),
        steps=cfg.train.steps,
        stop_file=stop_file,
        port_base=ports.base,
        server_args_file=args_file,
        preflight=preflight,
        layout=pl.to_dict() if pl else {},
        memory=memory_dict(layout) if layout else {},
        layout_text=layout_text,
    )


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
        "--health-timeout",
        type=float,
        help="seconds to wait for servers (default: scaled with the "
        "model and the number of servers, see launch/health.py)",
    )
    ap.add_argument(
        "--resume",
        default="auto",
        help="passed to dapo train: auto (default: the run's newest complete "
        "checkpoint, if any), none, or a checkpoint directory",
    )
    ap.add_argument(
        "--stop-before",
        type=float,
        help="stop the trainer (it saves) this many seconds before the job's "
        "time limit, read from scontrol (for a driver run as a job step: nemo-run)",
    )
    ap.add_argument(
        "--requeue-on-stop",
        action="store_true",
        help="after a time-limit stop, requeue the job from "
        "here (for a driver run as a job step, e.g. by nemo-run; slurm/common.sh requeues itself)",
    )
    ap.add_argument("--nemo", action="store_true", help="submit through nemo-run instead (see launch/nemo.py)")
    test = ap.add_argument_group("testing and debugging (replace the real programs)")
    test.add_argument(
        "--server-cmd",
        help="template for the server command: {python} {node} {port} {index} {gpu} {log_dir} {args_file}",
    )
    test.add_argument(
        "--trainer-cmd", help="template for the per-rank trainer command: {python} {server_urls} {log_dir} {resume}"
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
            recipe=args.recipe,
            overrides=args.overrides,
            nodes=args.nodes,
            nodelist=args.nodelist,
            gpus_per_node=args.gpus_per_node,
            ntasks_per_node=args.ntasks_per_node,
            log_dir=args.log_dir,
            python=args.python,
            health_timeout_s=args.health_timeout,
            resume=args.resume,
            server_cmd=args.server_cmd,
            trainer_cmd=args.trainer_cmd,
        )
        plan = build_plan(opts, dry_run=args.dry_run)
        if args.dry_run:
            print(json.dumps(plan.as_dict(), indent=1) if args.json else plan.describe())
            return 0
        from megatron_dapo.launch.preflight import (  # the GPU stack of the steps' interpreter, before a step
            launch_preflight,
        )

        launch_preflight(
            load_config(opts.recipe, opts.overrides),
            plan.gpus_per_node,
            len(plan.servers),
            opts.python,
            stand_ins=bool(opts.server_cmd or opts.trainer_cmd),
            in_image=plan.preflight,
        )
        print(plan.describe(), file=sys.stderr, flush=True)
        supervisor = Supervisor(plan, stop_before_s=args.stop_before or 0)
        rc = supervisor.run()
        if rc == EXIT_RESUMABLE and args.requeue_on_stop:
            requeue(plan.job_id, supervisor.say)
        return rc
    except (ConfigError, LaunchError) as e:
        print(f"dapo launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # run the importable module, not this __main__ copy, so that its exception classes are the ones nemo.py raises
    from megatron_dapo.launch.slurm import main as _main

    sys.exit(_main())
