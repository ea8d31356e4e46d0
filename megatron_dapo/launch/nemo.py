"""Submit a DAPO run through nemo-run (the optional extra ``[launch]``: nemo-run + leptonai==0.27.3).

    dapo launch --nemo --recipe dapo_32b --account A --partition P --nodes 16 --gpus-per-node 8 [key=value ...]
    dapo launch --nemo --executor local --recipe demo_cpu [key=value ...]

``--executor slurm`` (default): a ``run.SlurmExecutor`` with a ``run.LocalTunnel`` (submit from a machine that has
``sbatch``, e.g. a login node; its job_dir must be ``<NEMORUN_HOME>/experiments``). The job's single task runs, on the
head node with ``srun --overlap``, the same driver as ``slurm/*.sbatch`` (``python -m megatron_dapo.launch.slurm``),
which starts the SGLang server steps and the trainer step and fails fast. nemo-run polls the job with ``sacct``, so
the cluster needs Slurm accounting.

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

from megatron_dapo.launch.slurm import LaunchError


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
    ap.add_argument("--container-image", default=None)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--detach", action="store_true", help="return once submitted (Slurm)")
    ap.add_argument("--dryrun", action="store_true", help="let nemo-run print what it would submit")
    test = ap.add_argument_group("passed on to the Slurm driver (testing and debugging)")
    test.add_argument("--log-dir")
    test.add_argument("--server-cmd")
    test.add_argument("--trainer-cmd", help="template; {python} {server_urls} {log_dir} {resume}")
    return ap


def driver_args(args: argparse.Namespace) -> list[str]:
    """Arguments of ``python -m megatron_dapo.launch.slurm`` inside the job."""
    out = ["--recipe", args.recipe, *args.overrides]
    for flag in ("ntasks_per_node", "log_dir", "server_cmd", "trainer_cmd"):
        value = getattr(args, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return out


def build(args: argparse.Namespace):
    """-> (script, executor) for nemo-run."""
    run = _nemo_run()
    if args.executor == "local":
        if args.trainer_cmd:
            cmd = [t.format(python=args.python, server_urls="[]", log_dir=args.log_dir or "")
                   for t in shlex.split(args.trainer_cmd)]  # fmt: skip
        else:
            cmd = [args.python, "-m", "megatron_dapo.cli", "train", "--recipe", args.recipe, *args.overrides]
        k = args.ntasks_per_node or 1
        if k > 1:
            cmd = [args.python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={k}", "--no-python",
                   *cmd]  # fmt: skip
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
        container_image=args.container_image,
        tunnel=tunnel,
        # one driver task on the head node; it starts the other steps itself, sharing the nodes (--overlap)
        srun_args=["--nodes=1", "--ntasks=1", "--overlap", f"--chdir={os.getcwd()}"],
        env_vars={"PYTHONUNBUFFERED": "1"},
    )
    python = "python" if args.container_image else args.python
    # nemo-run joins the arguments into a shell line unquoted: quote them here
    quoted = [shlex.quote(a) for a in driver_args(args)]
    script = run.Script(path="megatron_dapo.launch.slurm", args=quoted, entrypoint=python, m=True)
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
