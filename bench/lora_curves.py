"""LoRA against full fine-tuning on the CPU demo task, at equal steps and batch: held-out accuracy per seed, the train
phase's time and peak memory as ratios measured in the same runs.

    .venv/bin/python bench/lora_curves.py run [--seeds 1 2 3] [--runs runs/lora_curves]     # ~25 min on 2 cores
    .venv/bin/python bench/lora_curves.py report [--seeds ...] [--runs ...] [--out bench/results]

The demo's supervised warm start trains the whole tiny model from random weights: a rank-limited update cannot do
that. So both arms start from the same warm start (``demo_cpu`` with no RL steps, converted to HF with ``dapo convert``)
and run the demo's 130 DAPO steps from it (``model.hf_init``): full fine-tuning at the demo's lr, LoRA (rank 16, alpha
32, the four targets) at its own lr (LoRA wants a larger one: 1e-2 diverged here, 3e-3 learned). Each seed runs both
arms; the warm start is shared. ``report`` reads each run's metrics.jsonl and writes ``lora_curves-<date>.md``/``.json``/``.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from plotting import save_curves  # noqa: E402  (bench/plotting.py: the script's own folder is on sys.path)

from megatron_dapo.metrics import read_metrics  # noqa: E402

ACC = "eval/synthetic/add2/avg@4"
ARMS = {
    "full": ["train.lr=1.0e-3", "train.min_lr=1.0e-4"],
    "lora": ["model.lora.rank=16", "model.lora.alpha=32", "train.lr=3.0e-3", "train.min_lr=3.0e-4"],
}
COMMON = ["model.tokenizer=char", "train.supervised_warmup_steps=0", "eval.at_start=true", "train.save_interval=0",
          "train.export_hf=false"]  # fmt: skip


def dapo(args: list[str], log: Path) -> None:
    with open(log, "w") as f:
        rc = subprocess.run(
            [str(REPO / ".venv/bin/dapo"), *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT
        ).returncode
    if rc:
        sys.exit(f"dapo {' '.join(args)} exited {rc}; see {log}")


def run(seeds: list[int], runs: Path) -> None:
    runs.mkdir(parents=True, exist_ok=True)
    warm_hf = runs / "warm_hf"
    if not (warm_hf / "config.json").is_file():
        print("the shared warm start: demo_cpu with no RL steps", flush=True)
        dapo(["train", "--recipe", "demo_cpu", "train.steps=0", "train.name=warm", f"train.run_dir={runs}"],
             runs / "warm.log")  # fmt: skip
        step0 = runs / "warm" / "checkpoints" / "step_000000"
        dapo(["convert", "megatron-to-hf", "--in", str(step0), "--out", str(warm_hf), "--overwrite", "--quiet"],
             runs / "warm_convert.log")  # fmt: skip
    for seed in seeds:
        for arm, overrides in ARMS.items():
            name = f"{arm}_s{seed}"
            print(f"seed {seed}, {arm}: 130 DAPO steps (log {runs / name}.log)", flush=True)
            dapo(["train", "--recipe", "demo_cpu", f"model.hf_init={warm_hf}", *COMMON, *overrides,
                  f"train.seed={seed}", f"train.name={name}", f"train.run_dir={runs}"], runs / f"{name}.log")  # fmt: skip


def summarize(run_dir: Path) -> dict:
    rows = read_metrics(run_dir)
    steps = [r for r in rows if r["step"] >= 1]
    return {
        "curve": [(r["step"], r[ACC]) for r in rows if ACC in r],
        "train_s": statistics.mean(r["time/train_s"] for r in steps),
        "step_s": statistics.mean(r["time/step_s"] for r in steps),
        "rss_peak_gib": max(r["mem/rss_peak_gib"] for r in steps),
        "samples_generated": steps[-1]["train/samples_generated_total"],
        "train_acc_last10": statistics.mean(r["train/acc_mean"] for r in steps[-10:]),
    }


def report(seeds: list[int], runs: Path, out_dir: Path) -> Path:
    per = {arm: {s: summarize(runs / f"{arm}_s{s}") for s in seeds} for arm in ARMS}
    evals = [step for step, _ in per["full"][seeds[0]]["curve"]]
    lines = [
        f"# LoRA against full fine-tuning, the CPU demo task ({datetime.date.today()})", "",
        "`bench/lora_curves.py`: both arms start from one supervised warm start of the demo model and run the demo's "
        "130 DAPO steps (64 prompts × 8 a step, 2 updates), seed by seed. Held-out accuracy is avg@4 at T = 1 on the "
        "200 held-out problems.", "",
        f"| arm | seed | {' | '.join(f'step {s}' for s in evals)} | train s/step | step s | peak RSS | samples generated |",
        "|---|---|" + "---|" * (len(evals) + 4),
    ]  # fmt: skip
    for arm, by_seed in per.items():
        for s, p in by_seed.items():
            accs = " | ".join(f"{a:.3f}" for _, a in p["curve"])
            lines.append(f"| {arm} | {s} | {accs} | {p['train_s']:.3f} | {p['step_s']:.2f} | "
                         f"{p['rss_peak_gib']:.2f} GiB | {p['samples_generated']:.0f} |")  # fmt: skip
    summary = {}
    for arm, by_seed in per.items():
        finals = [p["curve"][-1][1] for p in by_seed.values()]
        summary[arm] = {
            "final_mean": statistics.mean(finals), "final_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "train_s": statistics.mean(p["train_s"] for p in by_seed.values()),
            "rss": statistics.mean(p["rss_peak_gib"] for p in by_seed.values()),
        }  # fmt: skip
    f, lo = summary["full"], summary["lora"]
    starts = [p["curve"][0][1] for p in per["full"].values()]
    lines += [
        "",
        f"Final held-out accuracy: full fine-tuning **{f['final_mean']:.3f} ± {f['final_sd']:.3f}**, LoRA "
        f"**{lo['final_mean']:.3f} ± {lo['final_sd']:.3f}** (mean ± sd of {len(seeds)} seeds; the shared warm start "
        f"scores {min(starts):.3f}–{max(starts):.3f}, its avg@4 sampled with each seed). LoRA against full "
        "fine-tuning, measured in the same runs: "
        f"train phase **{lo['train_s'] / f['train_s']:.2f}×** the time a step, peak RSS "
        f"**{lo['rss'] / f['rss']:.2f}×** (the demo model has 0.5 M parameters: activations, not weights, fill its "
        "memory).",
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"lora_curves-{datetime.date.today()}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"runs": per, "summary": summary}, indent=1))
    plot(per, stem.with_suffix(".png"))
    print("\n".join(lines))
    return stem.with_suffix(".md")


def plot(per: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for arm, color in (("full", "tab:blue"), ("lora", "tab:orange")):
        for i, p in enumerate(per[arm].values()):
            xs, ys = zip(*p["curve"])
            ax.plot(xs, ys, marker="o", color=color, alpha=0.8, label=f"{arm}" if i == 0 else None)
    save_curves(fig, ax, path, "DAPO step (from the shared warm start)", "held-out avg@4 (200 problems)",
                "demo task: LoRA r16 vs full fine-tuning, 3 seeds")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["run", "report"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--runs", type=Path, default=REPO / "runs" / "lora_curves")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    if args.command == "run":
        run(args.seeds, args.runs)
    report(args.seeds, args.runs, args.out)


if __name__ == "__main__":
    main()
