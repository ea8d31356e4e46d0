"""Rollout schedules side by side on the long-tailed chain task (``recipes/chain_cpu.yaml``: responses of 2–7 running
sums, some past the 24-token limit), HF engine on CPU: ``sync`` vs ``partial`` (``rollout.partial=true``) vs
``one_step_off`` and ``async`` (``rollout.schedule``, max_staleness 2; the HF engine generates in the producer thread
on its own weights, beside training).

    .venv/bin/python bench/bench_schedule.py [--seeds 1] [--sample-budget 6144] [--minutes 2] [--schedules a,b]
    .venv/bin/python bench/bench_schedule.py --seeds 1 --sample-budget 64 --minutes 0.2 --warm-steps 5  # smoke, < 1 min

One short supervised warm start (the answer format, so lengths vary) is saved and shared; each schedule and seed then
trains from it with the same budget of generated samples. Reported per schedule (mean over seeds): samples generated
per second of rollout, rollout and step time per step, the carried/resumed samples and version lag (partial), and
held-out avg@4 at the end, and for one_step_off/async the batches' lag and the engine's idle fraction (the producer
waiting on its staleness bound or the sync). Writes ``schedule-<date>.md`` / ``.json`` to ``--out``. Not measured
here: SGLang servers (the HF engine decodes a micro-batch in lockstep: a carried sample only saves what the rows after
the cut had generated when it came). On 2 cores the producer thread and the trainer share the same cores, so
one_step_off/async overlap little here; the run that ends on its sample budget has made one batch it never trains.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OFF = ["rollout.colocate=false"]  # one_step_off/async: the engine on its own weights (refused when colocated)
SCHEDULES = {"sync": [], "partial": ["rollout.partial=true"], "one_step_off": ["rollout.schedule=one_step_off", *OFF],
             "async": ["rollout.schedule=async", "rollout.max_staleness=2", *OFF]}  # fmt: skip
# every group kept (a short warm start leaves most groups all wrong): B = 16 of 32 prompts a round, the rest surplus
SMALL = ["train.batch_prompts=16", "train.mini_batch_prompts=16", "algo.gen_batch_prompts=32",
         "algo.dynamic_sampling=false", "rollout.hf_max_batch=256", "data.synthetic_eval_size=100",
         "eval.interval=0"]  # fmt: skip
EVAL_KEY = "eval/synthetic/chain/avg@4"


def dapo(args: list[str], log: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "train", "--recipe", "chain_cpu", *SMALL,
                             *args], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode  # fmt: skip
    if rc:
        raise SystemExit(f"dapo train {' '.join(args)} failed ({rc}); log {log}:\n{log.read_text()[-3000:]}")


def summary(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/rollout_s" in r]
    rollout = sum(r["time/rollout_s"] for r in steps)
    samples = steps[-1]["train/samples_generated_total"]
    group = yaml.safe_load((run / "config.yaml").read_text())["algo"]["group_size"]
    trained = sum(r["train/kept_groups"] for r in steps) * group

    def mean(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in steps)

    return {
        "steps": len(steps), "samples": samples, "samples_per_rollout_s": samples / rollout if rollout else 0.0,
        "trained_samples_per_step_s": trained / sum(r["time/step_s"] for r in steps),
        "rollout_s_per_step": mean("time/rollout_s"), "step_s": mean("time/step_s"),
        "resumed_per_step": mean("rollout/resumed_samples"), "carried_per_step": mean("rollout/carried_samples"),
        "version_lag_mean": mean("rollout/version_lag_mean"), "partial_token_frac": mean("rollout/partial_token_frac"),
        "dropped_stale_groups": steps[-1].get("rollout/dropped_stale_groups_total", 0.0),
        "batch_lag": mean("rollout/batch_lag"),
        "engine_idle_frac": sum(r.get("time/engine_idle_s", 0.0) for r in steps) / sum(r["time/step_s"] for r in steps),
        "eval": rows[-1].get(EVAL_KEY),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--sample-budget", type=int, default=6144)
    ap.add_argument("--minutes", type=float, default=2.0, help="wall-clock cap of each run's RL")
    ap.add_argument("--warm-steps", type=int, default=200)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--work", default=None)
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help=f"a subset of {','.join(SCHEDULES)}")
    args = ap.parse_args()
    chosen = {name: SCHEDULES[name] for name in args.schedules.split(",")}
    work = Path(args.work or tempfile.mkdtemp(prefix="dapo_schedule_"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    dapo(["train.steps=0", f"train.supervised_warmup_steps={args.warm_steps}", "train.supervised_stop_acc=2.0",
          f"train.run_dir={work}", "train.name=warm"], work / "warm.log")  # fmt: skip
    ckpt = work / "warm" / "checkpoints" / "step_000000"
    results: dict[str, list[dict]] = {name: [] for name in chosen}
    for k in range(args.seeds):
        seed = 1234 + 17 * k
        for name, overrides in chosen.items():  # the schedules alternate, so all see the machine's load alike
            run = f"{name}-{seed}"
            dapo([f"train.seed={seed}", f"model.load={ckpt}", "train.supervised_warmup_steps=0", "train.steps=100000",
                  f"train.sample_budget={args.sample_budget}", f"train.time_budget_s={args.minutes * 60:g}",
                  *overrides, f"train.run_dir={work}", f"train.name={run}"], work / f"{run}.log")  # fmt: skip
            results[name].append(summary(work / run))
            print(f"{run}: {results[name][-1]}", flush=True)
    report(results, args, time.monotonic() - t0, Path(args.out))


def report(results: dict[str, list[dict]], args, seconds: float, out: Path) -> None:
    date = datetime.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)
    keys = ["trained_samples_per_step_s", "samples_per_rollout_s", "rollout_s_per_step", "step_s", "resumed_per_step", "carried_per_step",
            "version_lag_mean", "partial_token_frac", "dropped_stale_groups", "batch_lag", "engine_idle_frac", "eval",
            "steps", "samples"]  # fmt: skip
    lines = [f"# Rollout schedules on the chain task (HF engine, CPU) — {date}", "",
             f"{platform.machine()}, {os.cpu_count()} cores (shared: other jobs ran meanwhile), {args.seeds} seed(s), "
             f"budget {args.sample_budget} samples or {args.minutes} min per run; {seconds:.0f} s in all.", "",
             "| schedule | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]  # fmt: skip
    for name, runs in results.items():
        cells = []
        for key in keys:
            xs = [r[key] for r in runs if r[key] is not None]
            cells.append(f"{statistics.mean(xs):.3f}" if xs else "–")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (out / f"schedule-{date}.md").write_text("\n".join(lines) + "\n")
    (out / f"schedule-{date}.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
