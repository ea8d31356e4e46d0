"""`make demo-smollm` (recipe smollm2_math_cpu) once per seed, then what the seeds show: held-out accuracy of the base
model, after the format warm start (where DAPO starts) and at each eval, DAPO's gain against the seeds' spread, wall
time, samples/s, memory and the rollout/actor logprob gap.

    .venv/bin/python bench/smollm_seeds.py run [--seeds 1234 1235 1236] [--runs runs]      # ~22 min per seed, 2 cores
    .venv/bin/python bench/smollm_seeds.py report [--seeds ...] [--runs runs] [--out bench/results]
    .venv/bin/python bench/smollm_seeds.py run --lora [--seeds 1234]     # the same with LoRA (LORA below): smollm-lora-*

``run`` times each seed's whole `make demo-smollm` (GGUF cache check, server start, warm start, evals, the recipe's
steps, save) with GNU time and keeps its output as ``<runs>/smollm_s<seed>.time.log``; ``report`` reads those logs and each run's
metrics.jsonl and writes ``smollm-<date>.md`` / ``.json`` / ``.png`` (the held-out curve of every seed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from plotting import save_curves  # noqa: E402  (bench/plotting.py: the script's own folder is on sys.path)

from megatron_dapo.metrics import read_metrics  # noqa: E402

TASK = "synthetic/word_math"
ACC, FORMAT = f"eval/{TASK}/avg@1", f"eval/{TASK}/format@1"


# LoRA on every linear layer: rank 16, alpha 32, at 10x full fine-tuning's learning rates (warm start and DAPO). The
# server gets the merged weights: SGLang's only CPU LoRA backend (torch_native) decoded ~20 tokens/s at 64 requests
# here, too slow for this run (docs/guides/lora.md)
LORA = [
    "model.lora.rank=16",
    "model.lora.alpha=32",
    "train.lr=3.0e-5",
    "train.min_lr=3.0e-6",
    "train.supervised_lr=1.0e-4",
    "rollout.lora_sync=merged",
]
TAG = ""  # "_lora" with --lora


def run_name(seed: int) -> str:
    return f"smollm{TAG}_s{seed}"


def time_log(runs: Path, seed: int) -> Path:
    return runs / f"{run_name(seed)}.time.log"


def time_logs(runs: Path, seed: int) -> list[Path]:
    """The run's GNU time logs: a run stopped and resumed keeps its earlier parts as ``<name>.part<N>.time.log``."""
    return sorted(runs.glob(f"{run_name(seed)}.part*.time.log")) + [time_log(runs, seed)]


def run_seeds(seeds: list[int], runs: Path) -> None:
    runs.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        log = time_log(runs, seed)
        args = f"DEMO_ARGS=train.name={run_name(seed)} train.seed={seed} train.run_dir={runs}"
        args += " " + " ".join(LORA) if TAG else ""
        print(f"seed {seed}: make demo-smollm (log: {log})", flush=True)
        with open(log, "w") as f:
            rc = subprocess.run(["/usr/bin/time", "-v", "make", "demo-smollm", args], cwd=REPO, stdout=f,
                                stderr=subprocess.STDOUT).returncode  # fmt: skip
        if rc:
            sys.exit(f"seed {seed}: make demo-smollm exited {rc}; see {log}")


def gnu_time(logs: list[Path]) -> dict:
    """Wall seconds (summed over a resumed run's parts) and the largest process's peak RSS (GiB) from
    ``/usr/bin/time -v`` output."""
    secs, rss_kib = 0.0, 0
    for log in logs:
        text = log.read_text()
        wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text).group(1)
        secs += sum(float(p) * 60**i for i, p in enumerate(reversed(wall.split(":"))))
        rss_kib = max(rss_kib, int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)))
    return {"wall_s": secs, "max_rss_gib": rss_kib / 2**20, "parts": len(logs)}


def summarize_seed(run: Path, logs: list[Path]) -> dict:
    rows = read_metrics(run)
    group_size = yaml.safe_load((run / "config.yaml").read_text())["algo"]["group_size"]
    start = next(r for r in rows if r["step"] == 0)
    steps = [r for r in rows if r["step"] >= 1]
    rl_s = sum(r["time/step_s"] for r in steps)
    out = {
        "base_acc": start[f"base/{ACC}"], "base_format": start[f"base/{FORMAT}"],
        "warm_steps": start.get("sft/steps", 0.0), "start_acc": start[ACC],
        "curve": [(r["step"], r[ACC]) for r in rows if ACC in r],
        "final_acc": steps[-1][ACC], "steps": steps[-1]["step"], "held_out": int(start[f"eval/{TASK}/problems"]),
        "rl_s": rl_s, "step_s": rl_s / len(steps),
        "samples_generated": steps[-1]["train/samples_generated_total"],
        "trained_samples": sum(r["train/kept_groups"] for r in steps) * group_size,
        "logp_gap_mean": statistics.mean(r["train/logp_gap_mean"] for r in steps),
        "logp_gap_max": max(r["train/logp_gap_max"] for r in steps),
        "server_rss_gib": max((r.get("mem/children_rss_gib", float("nan")) for r in steps), default=float("nan")),
        **gnu_time(logs),
    }  # fmt: skip
    out["gain"] = out["final_acc"] - out["start_acc"]
    out["samples_per_s"] = out["samples_generated"] / rl_s
    return out


def report(seeds: list[int], runs: Path, out_dir: Path) -> Path:
    per = {s: summarize_seed(runs / run_name(s), time_logs(runs, s)) for s in seeds}
    finals, gains = [p["final_acc"] for p in per.values()], [p["gain"] for p in per.values()]
    spread = max(finals) - min(finals)
    held_out = {p["held_out"] for p in per.values()}
    assert len(held_out) == 1, f"the seeds evaluated different held-out sets: {held_out}"
    n = held_out.pop()
    verdict = "exceeds" if statistics.mean(gains) > spread and min(gains) > 0 else "does not exceed"
    lines = [
        f"# SmolLM2-135M-Instruct under DAPO on CPU{' with LoRA' if TAG else ''} ({datetime.date.today()})", "",
        f"`make demo-smollm` (recipe smollm2_math_cpu) per seed, on this machine's cores; {n} held-out word problems, "
        "greedy, scored by the DAPO rule (the same problems for every seed)."
        + (f" LoRA: `{' '.join(LORA)}`." if TAG else ""), "",
        "| seed | base acc (format) | warm-start steps | DAPO starts at | every eval after it | final | gain | wall "
        "| RL s/step | samples/s | logp gap mean / max | peak RSS actor / server |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for s, p in per.items():
        curve = " / ".join(f"{acc:.3f}" for step, acc in p["curve"] if 0 < step < p["steps"])
        parts = f" ({p['parts']} parts)" if p["parts"] > 1 else ""  # stopped and resumed
        lines.append(
            f"| {s} | {p['base_acc']:.3f} ({p['base_format']:.3f}) | {p['warm_steps']:.0f} | {p['start_acc']:.3f} | "
            f"{curve} | {p['final_acc']:.3f} | "
            f"{p['gain']:+.3f} | {p['wall_s'] / 60:.1f} min{parts} | {p['step_s']:.1f} | {p['samples_per_s']:.1f} | "
            f"{p['logp_gap_mean']:.4f} / {p['logp_gap_max']:.2f} | {p['max_rss_gib']:.1f} / "
            f"{p['server_rss_gib']:.1f} GiB |"
        )
    mean_gain, sd_gain = statistics.mean(gains), statistics.stdev(gains) if len(gains) > 1 else 0.0
    lines += [
        "", f"DAPO's gain over the warm start: **{mean_gain:+.3f} ± {sd_gain:.3f}** (mean ± sd of {len(seeds)} seeds); "
        f"final accuracy {statistics.mean(finals):.3f}, spread (max − min) over the seeds **{spread:.3f}**: the gain "
        f"{verdict} the spread. One held-out problem is {1 / n:.4f}; one greedy eval's sampling sd at this accuracy "
        f"is {(statistics.mean(finals) * (1 - statistics.mean(finals)) / n) ** 0.5:.3f}.",
    ]  # fmt: skip
    if len(seeds) == 1:  # no spread between seeds: the eval's own sampling sd is the yardstick
        lines[-1] = (f"DAPO's gain over the warm start: **{mean_gain:+.3f}** (one seed: no spread between seeds); final "
                     f"accuracy {finals[0]:.3f}; one greedy eval's sampling sd at this accuracy is "
                     f"{(finals[0] * (1 - finals[0]) / n) ** 0.5:.3f}.")  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"smollm{TAG.replace('_', '-')}-{datetime.date.today()}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"seeds": per, "spread": spread, "mean_gain": mean_gain}, indent=1))
    plot(per, stem.with_suffix(".png"), n)
    print("\n".join(lines))
    return stem.with_suffix(".md")


def plot(per: dict, path: Path, held_out: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for seed, p in per.items():
        xs, ys = zip(*p["curve"])
        ax.plot(xs, ys, marker="o", label=f"seed {seed}")
        ax.scatter([-3], [p["base_acc"]], color=ax.lines[-1].get_color(), marker="x")
    save_curves(fig, ax, path, "DAPO step (x at -3: the base model, before the format warm start)",
                f"held-out accuracy (greedy, {held_out})", "SmolLM2-135M-Instruct, word_math, DAPO on CPU")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["run", "report"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235, 1236])
    ap.add_argument("--runs", type=Path, default=REPO / "runs")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--lora", action="store_true", help="LoRA instead of full fine-tuning (LORA): runs smollm_lora_s*")
    args = ap.parse_args()
    global TAG
    TAG = "_lora" if args.lora else ""
    if args.command == "run":
        run_seeds(args.seeds, args.runs)
    report(args.seeds, args.runs, args.out)


if __name__ == "__main__":
    main()
