"""``dapo`` — train | eval | report | convert | plan | launch.

    dapo train --recipe demo_cpu [key=value ...] [--resume auto|none|DIR]
    dapo eval --load DIR --data PARQUET [--n 32] [--samples-out FILE] [key=value ...]
    dapo report RUN_DIR
    dapo convert hf-to-megatron|megatron-to-hf ...      (bridge/convert_cli.py)
    dapo plan --model qwen2.5-32b --max-prompt 2048 --max-response 20480 --nodes 16 --gpus-per-node 8 --gpu-mem 80
    dapo launch --recipe dapo_32b [--dry-run] ...        (inside or outside a Slurm allocation)
    dapo rehearse --recipe dapo_32b --nodes 16           (every rank of the GPU job built and checked on a CPU)

Multi-process training: ``torchrun --nproc-per-node N -m megatron_dapo.cli train ...`` (or ``dapo launch``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import warnings

from megatron_dapo.config.run_config import load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.data.dataset import DataError


def _train(args) -> int:
    from megatron_dapo.runs import StopRequest, exit_on_terminate

    stop = StopRequest.from_env().install()  # first: a SIGUSR1 during the slow imports below must not kill the rank
    exit_on_terminate()  # SIGTERM stops the servers this rank started instead of leaving them running
    from megatron_dapo.loop.trainer import Trainer

    cfg = load_config(args.recipe, args.overrides)
    from megatron_dapo.launch.preflight import train_preflight
    from megatron_dapo.loop.trainer import prepare_model_and_engine

    prepare_model_and_engine(cfg)  # gguf:... -> its HF directory; the HF engine when sglang is missing (and allowed)

    train_preflight(cfg)  # the GPU stack, this node's GPUs, the tensor sync's reach: before the model or a server
    trainer = Trainer(cfg, resume=args.resume, stop=stop)
    trainer.run()
    if trainer.is_driver and not trainer.stopped_early:
        run = trainer.run_dir
        print(f"\ncheckpoints: {run / 'checkpoints'}")
        for label, path in (("HF model:   ", run / "hf"), ("adapter:    ", run / "hf_adapter")):
            if path.is_dir():  # train.export_hf (on by default); the adapter of a LoRA run, in PEFT's format
                print(f"{label} {path}")
        print(f"metrics:     {run / 'metrics.jsonl'}")
        from megatron_dapo.report import make_report

        print(f"report:      {make_report(run)}")
    return 0


def _eval(args) -> int:
    from megatron_dapo.loop.evaluate import evaluate_checkpoint

    cfg = load_config(args.recipe, [f"eval.files=[{args.data}]", *args.overrides])
    if cfg.eval.greedy and args.n is not None:
        raise ConfigError(f"--n {args.n} would be ignored: eval.greedy = true (one greedy sample per problem)")
    if not cfg.eval.greedy:
        if (args.n or 32) < 1:
            raise ConfigError(f"--n {args.n}: must be >= 1")
        cfg.eval.n = args.n or 32  # avg@32 unless told: the AIME protocol, not the recipe's in-training eval.n
    results = evaluate_checkpoint(cfg, args.load, samples_out=args.samples_out)
    for key, value in sorted(results.items()):
        print(f"{key:40s} {value:.4f}")
    return 0


def _report(args) -> int:
    from megatron_dapo.report import main as report_main

    return report_main([args.run_dir, *args.rest])


def _convert(args) -> int:
    from megatron_dapo.bridge.convert_cli import hf_to_megatron_main, megatron_to_hf_main

    main = {"hf-to-megatron": hf_to_megatron_main, "megatron-to-hf": megatron_to_hf_main}[args.direction]
    try:
        return main(args.rest)
    except SystemExit as e:
        return int(e.code or 0)


def _plan(argv: list[str]) -> int:
    from megatron_dapo.planning.cli import main as plan_main

    return plan_main(argv)


def _rehearse(argv: list[str]) -> int:
    from megatron_dapo.planning.rehearsal import main as rehearse_main

    return rehearse_main(argv)


def _launch(argv: list[str]) -> int:
    from megatron_dapo.launch.slurm import main as launch_main

    return launch_main(argv)


# Commands with their own argument parsers: everything after the command name is theirs.
PASSTHROUGH = {"plan": _plan, "launch": _launch, "rehearse": _rehearse}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dapo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run DAPO training from a recipe")
    p.add_argument("--recipe", default="demo_cpu", help="recipe name (megatron_dapo/recipes/) or YAML path")
    p.add_argument(
        "--resume",
        default="auto",
        help="auto (default): continue from the run's newest complete checkpoint, if any; none: start fresh (refused "
        "when the run already has checkpoints); or a checkpoint directory",
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.eps_high=0.3 train.steps=10")
    p.set_defaults(func=_train)

    p = sub.add_parser("eval", help="evaluate a checkpoint: avg@k, pass@k, maj@k per data_source")
    p.add_argument("--load", required=True, help="megatron-dapo checkpoint directory")
    p.add_argument("--data", required=True, help="parquet in the DAPO schema (e.g. aime-2024.parquet)")
    p.add_argument("--n", type=int, default=None, help="samples per problem (default 32)")
    p.add_argument("--recipe", default="demo_cpu", help="recipe for the model/rollout settings")
    p.add_argument("--samples-out", help="also write every scored sample (prompt, response, score) to this JSONL")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_eval)

    p = sub.add_parser("report", help="metrics.jsonl -> report.png")
    p.add_argument("run_dir")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_report)

    p = sub.add_parser("convert", help="HF <-> megatron checkpoint conversion (dapo convert DIRECTION --help)")
    p.add_argument("direction", choices=["hf-to-megatron", "megatron-to-hf"])
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_convert)

    sub.add_parser("plan", help="memory/parallelism planner (dapo plan --help)", add_help=False)
    sub.add_parser("launch", help="Slurm launcher; --dry-run prints the plan (dapo launch --help)", add_help=False)
    sub.add_parser(
        "rehearse", help="the GPU job's every rank built and checked on a CPU (dapo rehearse --help)", add_help=False
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    # megatron-core warns at import that TE/apex are absent: expected on CPU, where the local spec is used.
    warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine).*")
    argv = sys.argv[1:] if argv is None else argv
    _stacks_on_sigusr2()
    if argv and argv[0] in PASSTHROUGH:
        return PASSTHROUGH[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DataError, FileNotFoundError) as e:  # bad input, found before compute
        return _fail(e, 2)
    except RuntimeError as e:  # expected run-time failures: one line, no traceback; anything else keeps its traceback
        if not {c.__name__ for c in type(e).__mro__} & EXPECTED_RUNTIME_ERRORS:
            raise
        return _fail(e, 1)


def _stacks_on_sigusr2() -> None:
    """``kill -USR2 <pid>`` prints every thread's Python stack to stderr and the run goes on: what a run that seems
    hung is waiting for (SIGUSR1 is the save-and-stop signal, loop/trainer.py)."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR2"):
        with contextlib.suppress(ValueError, RuntimeError, io.UnsupportedOperation):  # no stderr fd (embedded)
            faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)


# Failures the run reports in words (each message names what failed and what to do): no traceback, from rank 0 only
# (every rank raises the same error, see trainer.on_driver). By class name (or a base's): their modules import torch.
EXPECTED_RUNTIME_ERRORS = {
    "DynamicSamplingError",
    "LogprobGapError",
    "WeightSyncError",
    "RolloutError",
    "CheckpointError",
    "DriverError",
}


def _fail(e: Exception, code: int) -> int:
    if type(e).__name__ == "PreflightError" and os.environ.get("LOCAL_RANK", "0") == "0":  # one per node: its own
        print(f"error: {os.uname().nodename}: {e}", file=sys.stderr, flush=True)
    elif os.environ.get("RANK", "0") == "0":
        print(f"error: {e}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
