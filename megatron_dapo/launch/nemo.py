"""Submit a DAPO run through nemo-run (the optional extra ``[launch]``: nemo-run + leptonai==0.27.3).

    dapo launch --nemo --recipe dapo_32b --account A --partition P --nodes 16 --gpus-per-node 8 [key=value ...]
    dapo launch --nemo --executor local --recipe demo_cpu [key=value ...]

``--executor slurm`` (default): a ``run.SlurmExecutor`` with a ``run.LocalTunnel`` (submit from a machine that has
``sbatch``, e.g. a login node; its job_dir must be ``<NEMORUN_HOME>/experiments``). nemo-run packages the code
(``--packager pattern``: this working tree's package, model configs, tools, slurm scripts and data; ``git``: the
committed tree) into ``<job dir>/code``. The job's single task is the driver of ``slurm/*.sbatch``
(``python -m megatron_dapo.launch.slurm``), run on the allocation's first node, on the host, in that code directory
(the executor has no image, so nemo-run gives the step ``--chdir <job dir>/code``): it calls ``srun`` itself, which a
container without the Slurm client could not. It starts the SGLang server steps and the trainer step, and those run
in ``--container-image`` (``cluster.container_image``, with the code directory mounted at the same path and used as
the working directory: the packaged code is what runs there too). ``--stop-before`` seconds before the time limit
(the driver reads the job's end from scontrol: a step cannot get the batch script's signal alone) the trainer saves,
the driver requeues the job (``scontrol requeue``: same id, same options) and the next allocation resumes (``--resume auto``). nemo-run's own requeue on failure (``--retries``: any non-zero
exit, bad input included) is off by default. Paths in the overrides are read on the cluster, from
``<job dir>/code``: give absolute ones (a local recipe file is made absolute here). nemo-run polls the job with
``sacct``, so the cluster needs Slurm accounting.

``--executor local``: a ``run.LocalExecutor`` on this machine that runs the trainer itself
(``python -m megatron_dapo.cli train``; under ``torch.distributed.run --standalone`` when ``--ntasks-per-node`` > 1).

nemo-run is imported only here, lazily: the rest of the package never needs it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from megatron_dapo.launch.slurm_env import LaunchError


def _nemo_run():
    try:
        import nemo_run
    except ImportError as e:
        raise LaunchError(
            f"nemo-run is not installed ({e}): pip install 'megatron-dapo[launch]' (nemo-run, leptonai==0.27.3)"
        ) from e
    return nemo_run


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dapo launch --nemo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    ap.add_argument("--executor", choices=("slurm", "local"), default="slurm")
    ap.add_argument("--title", default=None, help="experiment title (default: dapo-<recipe name>)")
    ap.add_argument("--account", default=None)
    ap.add_argument("--partition", default=None)
    ap.add_argument("--time", default="04:00:00", help="Slurm time limit")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=None, help="Slurm: GPUs to request per node (GPU runs)")
    ap.add_argument("--ntasks-per-node", type=int, default=None, help="trainer ranks per node")
    ap.add_argument("--exclusive", action="store_true", help="Slurm: whole nodes")
    ap.add_argument("--container-image", help="image of the server and trainer steps (pyxis); the driver: the host")
    ap.add_argument("--container-mounts", default=None, help="comma-separated SRC:DST for the steps' containers")
    ap.add_argument(
        "--packager",
        choices=("pattern", "git"),
        default="pattern",
        help="what nemo-run ships to <job dir>/code: this working tree (pattern) or the committed tree (git)",
    )
    ap.add_argument(
        "--python",
        default=sys.executable,
        help="the host's interpreter for the driver (and for steps without an image); it needs this package's "
        "dependencies, the package itself comes packaged",
    )
    ap.add_argument("--resume", default="auto", help="auto (default) | none | a checkpoint directory")
    ap.add_argument(
        "--stop-before",
        type=int,
        default=900,
        help="Slurm: this many seconds before the time limit (one step + one save) the trainer saves and the job "
        "requeues",
    )
    ap.add_argument(
        "--retries",
        type=int,
        default=0,
        help="Slurm: nemo-run requeues a job that exits non-zero this many times (failures and bad input alike; the "
        "time-limit stop requeues itself)",
    )
    ap.add_argument("--driver-dry-run", action="store_true", help="the driver prints its plan (JSON) and exits")
    ap.add_argument("--detach", action="store_true", help="return once submitted (Slurm)")
    ap.add_argument("--dryrun", action="store_true", help="let nemo-run print what it would submit")
    test = ap.add_argument_group("passed on to the Slurm driver (testing and debugging)")
    test.add_argument("--log-dir")
    test.add_argument("--server-cmd")
    test.add_argument("--trainer-cmd", help="template; {python} {server_urls} {log_dir} {resume}")
    return ap


# What --packager pattern ships, relative to the repository root (the package's parent in an editable install).
PACKAGED = ("megatron_dapo", "model_configs", "tools", "slurm", "data", "pyproject.toml")


def driver_args(args: argparse.Namespace) -> list[str]:
    """Arguments of ``python -m megatron_dapo.launch.slurm`` inside the job."""
    recipe = str(Path(args.recipe).resolve()) if Path(args.recipe).is_file() else args.recipe  # read from code/
    out = ["--recipe", recipe, *args.overrides, "--resume", args.resume, "--requeue-on-stop"]
    out += ["--stop-before", str(args.stop_before)]
    if args.container_image:
        out.append(f"cluster.container_image={args.container_image}")
    if args.container_mounts:
        out.append(f"cluster.container_mounts=[{args.container_mounts}]")
    for flag in ("ntasks_per_node", "log_dir", "server_cmd", "trainer_cmd"):
        value = getattr(args, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    if args.driver_dry_run:
        out += ["--dry-run", "--json"]
    return out


def packager(run, kind: str):
    """nemo-run's packager of this code: it is unpacked in <job dir>/code, the driver's working directory."""
    if kind == "git":
        return run.GitArchivePackager()
    from megatron_dapo.config.run_config import PACKAGE_DIR

    root = PACKAGE_DIR.parent
    present = [name for name in PACKAGED if (root / name).exists()]
    return run.PatternPackager(
        include_pattern=[str(root / name) for name in present], relative_path=[str(root)] * len(present)
    )


def build(args: argparse.Namespace):
    """-> (script, executor) for nemo-run."""
    run = _nemo_run()
    if args.executor == "local":
        if args.trainer_cmd:
            cmd = [
                t.format(python=args.python, server_urls="[]", log_dir=args.log_dir or "", resume=args.resume)
                for t in shlex.split(args.trainer_cmd)
            ]
        else:
            cmd = [
                args.python,
                "-m",
                "megatron_dapo.cli",
                "train",
                "--recipe",
                args.recipe,
                *args.overrides,
                "--resume",
                args.resume,
            ]
        k = args.ntasks_per_node or 1
        if k > 1:
            cmd = [
                args.python,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={k}",
                "--no-python",
                *cmd,
            ]
        script = run.Script(inline=f"cd {shlex.quote(os.getcwd())} && exec {shlex.join(cmd)}")
        return script, run.LocalExecutor(ntasks_per_node=1)

    if not args.account:
        raise LaunchError("--account is required with --executor slurm (nemo-run's SlurmExecutor needs one)")
    from nemo_run.config import get_nemorun_home

    tunnel = run.LocalTunnel(job_dir=os.path.join(get_nemorun_home(), "experiments"))
    executor = run.SlurmExecutor(
        account=args.account,
        partition=args.partition,
        time=args.time,
        nodes=args.nodes,
        ntasks_per_node=1,
        gpus_per_node=args.gpus_per_node,
        exclusive=True if args.exclusive else None,
        container_image=None,  # the driver runs on the host, in <job dir>/code; its steps take the image
        tunnel=tunnel,
        packager=packager(run, args.packager),
        retries=args.retries,
        # one driver task on the head node; it starts the other steps itself, sharing the nodes (--overlap)
        srun_args=["--nodes=1", "--ntasks=1", "--overlap"],
        env_vars={"PYTHONUNBUFFERED": "1"},
    )
    # nemo-run joins the arguments into a shell line unquoted: quote them here
    quoted = [shlex.quote(a) for a in driver_args(args)]
    script = run.Script(path="megatron_dapo.launch.slurm", args=quoted, entrypoint=args.python, m=True)
    return script, executor


def main(argv: list[str] | None = None) -> int:
    """``dapo launch --nemo ...``; returns 0 when the nemo-run task succeeded (or was submitted, with --detach)."""
    args = make_parser().parse_intermixed_args(argv)
    script, executor = build(args)
    run = _nemo_run()
    title = args.title or f"dapo-{Path(args.recipe).stem}"
    with run.Experiment(title, executor=executor, log_level="WARN") as exp:
        exp.add(script, executor=executor, name="dapo")
        if args.dryrun:
            exp.dryrun()
            return 0
        detach = args.detach and args.executor == "slurm"
        exp.run(detach=detach, tail_logs=False)
        if detach:
            print(f"submitted nemo-run experiment {exp._id}; follow it with: nemo experiment status {exp._id}")
            return 0
    # leaving the with-block waited for the jobs and recorded their final states
    states = {job.id: getattr(job.state, "name", str(job.state)) for job in exp.jobs}
    print(f"nemo-run experiment {exp._id}: {states}", file=sys.stderr)
    return 0 if states and all(s == "SUCCEEDED" for s in states.values()) else 1
