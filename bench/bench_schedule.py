"""Rollout schedules side by side on the long-tailed chain task (``recipes/chain_cpu.yaml``: responses of 2–7 running
sums, some past the 24-token limit): ``sync`` vs ``partial`` (``rollout.partial=true``) vs ``one_step_off`` and
``async`` (``rollout.schedule``, max_staleness 2) and ``stream`` (staleness 0.5, the sync interrupting) and
``stream_train`` (stream with streaming training: ``--old-logprobs rollout --mini-batch-prompts 4``), rolled out by the
HF engine in the trainer's process (``--engine hf``;
one_step_off/async generate in a producer thread on their own copy of the weights) or by the real SGLang server on
CPU cores (``--engine sglang``: ``recipes/chain_cpu_sglang.yaml``, one server per run, its own processes).

    .venv/bin/python bench/bench_schedule.py [--engine sglang] [--seeds 1] [--sample-budget 6144] [--minutes 2]
    .venv/bin/python bench/bench_schedule.py --seeds 1 --sample-budget 64 --minutes 0.2 --warm-steps 5 --warm-stop-acc 2  # smoke

One supervised warm start (the answer format, so lengths vary; until 15% held-out accuracy, as chain_cpu's, so the
schedules' accuracy can be compared) is saved and shared; each schedule and seed then
trains from it with the same budget of generated samples. Reported per schedule (mean over seeds): samples generated
per second of rollout, rollout and step time per step, the carried/resumed samples and version lag (partial), and
held-out avg@4 at the end, and for one_step_off/async the batches' lag and the engine's idle fraction (the producer
waiting on its staleness bound or the sync). Writes ``schedule-<date>[-sglang].md`` / ``.json`` to ``--out``. With the
HF engine a micro-batch decodes in lockstep, so a carried sample only saves what the rows after the cut had generated
when it came, and on 2 cores the producer thread and the trainer share the same cores (one_step_off/async overlap
little); the SGLang server decodes each request on its own (continuous batching) in its own processes. A run that ends
on its sample budget has made one batch it never trains (one_step_off/async).
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
             "async": ["rollout.schedule=async", "rollout.max_staleness=2", *OFF],
             "stream": ["rollout.schedule=stream", "rollout.stream_staleness=0.5", *OFF],
             # streaming training: each mini-batch update as soon as its groups are kept (needs --old-logprobs rollout)
             "stream_train": ["rollout.schedule=stream", "rollout.stream_staleness=0.5", *OFF,
                              "train.stream_updates=true"]}  # fmt: skip
# every group kept (a short warm start leaves most groups all wrong): B = 16 of 32 prompts a round, the rest surplus
# lr 1e-4 decaying to 1e-5 over the run: chain_cpu's 1e-3 collapses RL (ppo_kl ~0.1; seen here: the sync runs fell
# from 0.20 to 0.00 training accuracy within 18 steps, and the 2026-12-01 bench's held-out accuracy was 0 for every
# schedule); 1e-4 is what bench/ablation.py's sweep chose (per-step ppo_kl below 1e-3)
SMALL = ["train.batch_prompts=16", "train.mini_batch_prompts=16", "algo.gen_batch_prompts=32",
         "algo.dynamic_sampling=false", "data.synthetic_eval_size=100", "eval.interval=0", "train.lr=1e-4",
         "train.min_lr=1e-5"]  # fmt: skip
EVAL_KEY = "eval/synthetic/chain/avg@4"
# (recipe, its overrides); the warm start is made once, with the HF engine
ENGINES = {"hf": ("chain_cpu", ["rollout.hf.max_batch=256"]), "sglang": ("chain_cpu_sglang", [])}


def dapo(args: list[str], log: Path, engine: str = "hf") -> None:
    recipe, engine_args = ENGINES[engine]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "train", "--recipe", recipe, *SMALL, *engine_args,
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
        "trainer_idle_ratio": mean("rollout/trainer_idle_ratio"), "rollout_idle_ratio": mean("rollout/rollout_idle_ratio"),
        "partial_ratio": mean("rollout/partial_ratio"), "interrupted": steps[-1].get("rollout/interrupted_samples_total", 0.0),
        "tis_masked_frac": mean("train/tis_masked_frac"), "lag_hist": _lag_histogram(steps),
        "eval": rows[-1].get(EVAL_KEY),
    }  # fmt: skip


def _lag_histogram(steps: list[dict]) -> str:
    """Steps by their batch's largest token lag (versions behind the trainer): "lag:steps" pairs."""
    counts: dict[int, int] = {}
    for r in steps:
        lag = int(r.get("rollout/version_lag_max", 0))
        counts[lag] = counts.get(lag, 0) + 1
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=sorted(ENGINES), default="hf")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--sample-budget", type=int, default=6144)
    ap.add_argument("--minutes", type=float, default=2.0, help="wall-clock cap of each run's RL")
    ap.add_argument("--warm-steps", type=int, default=1500, help="supervised warm start: at most this many steps")
    ap.add_argument(
        "--warm-stop-acc",
        type=float,
        default=0.15,
        help="... or until held-out accuracy reaches this (chain_cpu's; 2 = never), so accuracy can move",
    )
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--work", default=None)
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help=f"a subset of {','.join(SCHEDULES)}")
    ap.add_argument("--corrections", default="", help="each schedule once per mismatch correction (algo/corrections.py "
                    "names, 'off' for none): rows 'schedule/correction', every token weighed (algo.tis=on)")  # fmt: skip
    ap.add_argument(
        "--old-logprobs",
        choices=["recompute", "rollout"],
        default="recompute",
        help="algo.old_logprobs: 'rollout' drops the π_old forward, the correction then compares with it",
    )
    ap.add_argument("--mini-batch-prompts", type=int, default=16, help="train.mini_batch_prompts (B is 16)")
    args = ap.parse_args()
    chosen = {name: [*SCHEDULES[name], f"algo.old_logprobs={args.old_logprobs}",
                     f"train.mini_batch_prompts={args.mini_batch_prompts}"] for name in args.schedules.split(",")}  # fmt: skip
    if args.corrections:
        chosen = {f"{name}/{c}": [*over, *(["algo.tis=off"] if c == "off" else ["algo.tis=on", f"algo.correction={c}"])]
                  for name, over in chosen.items() for c in args.corrections.split(",")}  # fmt: skip
    work = Path(args.work or tempfile.mkdtemp(prefix="dapo_schedule_"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ckpt = work / "warm" / "checkpoints" / "step_000000"
    if not (ckpt / "dapo_meta.json").exists():  # a --work directory's warm start is reused
        dapo(["train.steps=0", f"train.supervised_warmup_steps={args.warm_steps}",
              f"train.supervised_stop_acc={args.warm_stop_acc}", f"train.run_dir={work}", "train.name=warm"],
             work / "warm.log")  # fmt: skip
    results: dict[str, list[dict]] = {name: [] for name in chosen}
    for k in range(args.seeds):
        seed = 1234 + 17 * k
        for name, overrides in chosen.items():  # the schedules alternate, so all see the machine's load alike
            run = f"{name.replace('/', '-')}-{seed}"
            dapo([f"train.seed={seed}", f"model.load={ckpt}", "train.supervised_warmup_steps=0", "train.steps=100000",
                  f"train.sample_budget={args.sample_budget}", f"train.time_budget_s={args.minutes * 60:g}",
                  *overrides, f"train.run_dir={work}", f"train.name={run}"], work / f"{run}.log",
                 args.engine)  # fmt: skip
            results[name].append(summary(work / run))
            print(f"{run}: {results[name][-1]}", flush=True)
    report(results, args, time.monotonic() - t0, Path(args.out))


def report(results: dict[str, list[dict]], args, seconds: float, out: Path) -> None:
    date = datetime.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)
    keys = ["trained_samples_per_step_s", "samples_per_rollout_s", "rollout_s_per_step", "step_s", "resumed_per_step", "carried_per_step",
            "version_lag_mean", "partial_token_frac", "dropped_stale_groups", "batch_lag", "engine_idle_frac",
            "trainer_idle_ratio", "rollout_idle_ratio", "partial_ratio", "interrupted", "tis_masked_frac", "eval", "steps",
            "samples"]  # fmt: skip
    engine = {"hf": "HF engine", "sglang": "the real SGLang server"}[args.engine]
    lines = [f"# Rollout schedules on the chain task ({engine}, CPU) — {date}", "",
             f"algo.old_logprobs={args.old_logprobs}, train.mini_batch_prompts={args.mini_batch_prompts} (of 16)",
             "",
             f"{platform.machine()}, {os.cpu_count()} cores (shared: other jobs ran meanwhile), {args.seeds} seed(s), "
             f"budget {args.sample_budget} samples or {args.minutes} min per run; {seconds:.0f} s in all.", "",
             "| schedule | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]  # fmt: skip
    for name, runs in results.items():
        cells = []
        for key in keys:
            xs = [r[key] for r in runs if r[key] is not None]
            cells.append(f"{statistics.mean(xs):.3f}" if xs else "–")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Steps by their batch's largest token lag behind the trainer (lag:steps), per seed:", ""]
    lines += [f"- {name}: " + "; ".join(r["lag_hist"] for r in runs) for name, runs in results.items()]
    stem = (
        f"schedule-{date}"
        + ("-sglang" if args.engine == "sglang" else "")
        + ("-corrections" if args.corrections else "")
        + ("-stream-train" if "stream_train" in args.schedules else "")
    )
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
