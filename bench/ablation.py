"""The DAPO ablation ladder at toy scale (the paper's Table 1), on CPU: does each technique earn its place?

    .venv/bin/python bench/ablation.py [--seeds 3] [--sample-budget 51200] [--minutes 2.5] [--jobs 2]   # make ablation

Task: ``recipes/chain_cpu.yaml`` (sums of 2–7 digits written out as running sums, ``data/chain.py``: variable-length
reasoning, long solutions past the 24-token limit, easy problems that saturate, a peaked warm-started policy). One
supervised warm start (to ``supervised_stop_acc``), saved and shared by every rung and seed (the seeds vary the RL:
sampling, prompt order; the spread over seeds is RL's, not the warm start's); then each rung trains from it with the
SAME budget: ``--sample-budget`` generated samples, and at most ``--minutes`` of RL.

Rungs (cumulative, as in the paper): naive GRPO (clip 0.2/0.2, sequence-mean loss, no shaping, no filtering) →
+ overlong filtering → + clip-higher (0.28) → + soft overlong punishment (instead of filtering, as DAPO's recipe) →
+ token-level loss → + dynamic sampling (= DAPO). Baseline: the warm start continued supervised for the same minutes.

Writes ``ablation-<date>.md`` (held-out avg@4 mean ± std over seeds, and at the end of training: entropy, response
length, truncated fraction, samples generated per kept sample) and ``ablation-<date>.png`` (held-out accuracy against
samples generated) to ``--out``. Runs ``--jobs`` trainings at a time, one thread each.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NAIVE = ["algo.eps_high=0.2", "algo.loss_agg=seq-mean-token-mean", "algo.overlong_penalty=false",
         "algo.overlong_filter=false", "algo.dynamic_sampling=false", "algo.gen_batch_prompts=64"]  # fmt: skip
RUNGS = [  # (name, overrides on top of chain_cpu)
    ("naive GRPO", NAIVE),
    ("+ overlong filtering", [*NAIVE, "algo.overlong_filter=true"]),
    ("+ clip-higher", [*NAIVE, "algo.overlong_filter=true", "algo.eps_high=0.28"]),
    ("+ soft overlong punishment", [*NAIVE, "algo.eps_high=0.28", "algo.overlong_penalty=true"]),
    ("+ token-level loss", [*NAIVE, "algo.eps_high=0.28", "algo.overlong_penalty=true", "algo.loss_agg=token-mean"]),
    ("+ dynamic sampling (DAPO)", []),
]
EVAL_KEY = "eval/synthetic/chain/avg@4"


def dapo(args: list[str], log: Path, threads: int = 1) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "train", "--recipe", "chain_cpu", *args],
                            cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode  # fmt: skip
    if rc:
        raise SystemExit(f"dapo train {' '.join(args)} failed ({rc}); log {log}:\n{log.read_text()[-3000:]}")


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sample-budget", type=int, default=51200, help="generated samples per rung (default 100 steps)")
    ap.add_argument("--minutes", type=float, default=2.5, help="wall-clock cap of each rung's RL")
    ap.add_argument("--jobs", type=int, default=2, help="trainings at a time (one thread each)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--work", default=None, help="run directory (default: a new temporary one)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="dapo_ablation_"))
    work.mkdir(parents=True, exist_ok=True)
    seeds = [1234 + 17 * k for k in range(args.seeds)]
    t0 = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=args.jobs)

    # one warm start for every rung and seed: a zero-step run saves it (step_000000) after its supervised warm-up
    dapo([f"train.seed={seeds[0]}", "train.steps=0", f"train.run_dir={work}", "train.name=warm"], work / "warm.log",
         threads=args.jobs)  # fmt: skip
    print(f"warm starts done in {time.monotonic() - t0:.0f} s", flush=True)
    budget = [f"train.sample_budget={args.sample_budget}", f"train.time_budget_s={args.minutes * 60:g}",
              "train.steps=100000", "train.supervised_warmup_steps=0"]  # fmt: skip

    def rung(job: tuple[int, int]) -> None:
        k, seed = job
        name, overrides = RUNGS[k]
        ckpt = work / "warm" / "checkpoints" / "step_000000"
        dapo([f"train.seed={seed}", f"model.load={ckpt}", *budget, *overrides, f"train.run_dir={work}",
              f"train.name=rung{k}-{seed}"], work / f"rung{k}-{seed}.log")  # fmt: skip
        print(f"{name}, seed {seed}: done at {time.monotonic() - t0:.0f} s", flush=True)

    def supervised(seed: int) -> None:
        ckpt = work / "warm" / "checkpoints" / "step_000000"
        dapo([f"train.seed={seed}", f"model.load={ckpt}", "train.steps=0", "train.supervised_warmup_steps=1000000",
              "train.supervised_stop_acc=2.0", f"train.time_budget_s={args.minutes * 60:g}", f"train.run_dir={work}",
              f"train.name=sft-{seed}"], work / f"sft-{seed}.log")  # fmt: skip

    jobs = [(k, s) for s in seeds for k in range(len(RUNGS))]
    futures = [pool.submit(rung, j) for j in jobs] + [pool.submit(supervised, s) for s in seeds]
    for f in futures:
        f.result()
    report(work, seeds, args, time.monotonic() - t0, Path(args.out))


def summarize(work: Path, seeds: list[int]) -> dict:
    out = {}
    for k, (name, _) in enumerate(RUNGS):
        finals, tail, curves = [], [], []
        for seed in seeds:
            r = rows(work / f"rung{k}-{seed}")
            start = rows(work / "warm")[0]
            evals = [(x.get("train/samples_generated_total", 0), x[EVAL_KEY]) for x in r if EVAL_KEY in x]
            curves.append([(0, start[EVAL_KEY]), *evals])
            finals.append(evals[-1][1])
            steps = [x for x in r if "train/entropy" in x][-5:]
            generated = max(x["train/samples_generated_total"] for x in r)
            kept = sum(x["train/kept_groups"] for x in r if "train/kept_groups" in x) * 8
            tail.append({
                "entropy": statistics.mean(x["train/entropy"] for x in steps),
                "length": statistics.mean(x["train/response_len_mean"] for x in steps),
                "truncated": statistics.mean(x["train/truncated_frac"] for x in steps),
                "per_kept": generated / max(kept, 1), "steps": r[-1]["step"],
            })  # fmt: skip
        out[name] = {"final": finals, "tail": tail, "curves": curves}
    sft = [rows(work / f"sft-{s}")[-1].get(EVAL_KEY) for s in seeds]
    start = [rows(work / "warm")[0][EVAL_KEY]]
    return {"rungs": out, "sft": sft, "start": start}


def _ms(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.3f}"


def report(work: Path, seeds: list[int], args, seconds: float, out_dir: Path) -> None:
    s = summarize(work, seeds)
    date = datetime.date.today().isoformat()
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    lines = [
        f"# DAPO ablation ladder, chain-sum toy — {date}",
        "",
        f"Machine: {machine}; {len(seeds)} seeds; budget per rung: {args.sample_budget} generated samples or "
        f"{args.minutes:g} min of RL, whichever comes first; {args.jobs} runs at a time, 1 thread each; "
        f"{seconds / 60:.1f} min in all. Warm start (held-out avg@4): {_ms(s['start'])}.",
        "",
        "| rung | held-out avg@4 | entropy | response length | truncated | generated / kept sample | steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in s["rungs"].items():
        t = r["tail"]
        lines.append(
            f"| {name} | {_ms(r['final'])} | {_ms([x['entropy'] for x in t])} | {_ms([x['length'] for x in t])} | "
            f"{_ms([x['truncated'] for x in t])} | {_ms([x['per_kept'] for x in t])} | "
            f"{statistics.mean(x['steps'] for x in t):.0f} |"
        )
    lines.append(f"| supervised only (same minutes) | {_ms(s['sft'])} | | | | | |")
    lines += ["", "Entropy, length and truncation: means over each run's last 5 steps; ± is the std over seeds."]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"ablation-{date}.md").write_text(text)
    (out_dir / f"ablation-{date}.json").write_text(json.dumps({"date": date, "machine": machine, **s}, indent=2))
    plot(s, out_dir / f"ablation-{date}.png")


def plot(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in s["rungs"].items():
        for i, curve in enumerate(r["curves"]):
            xs, ys = zip(*curve)
            ax.plot([x / 1000 for x in xs], ys, color=f"C{list(s['rungs']).index(name)}", alpha=0.8,
                    label=name if i == 0 else None)  # fmt: skip
    ax.axhline(statistics.mean(s["sft"]), color="gray", ls="--", label="supervised only (final)")
    ax.set(xlabel="samples generated (thousands)", ylabel="held-out avg@4", title="DAPO ablation ladder (chain sums)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
