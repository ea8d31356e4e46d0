"""The DAPO ablation ladder (the paper's Table 1) on a CPU toy in the paper's regime: does each technique earn its place?

    .venv/bin/python bench/ablation.py [--seeds 5] [--steps 100] [--jobs 2] [--lr 1e-4]   # make ablation
    .venv/bin/python bench/ablation.py sweep --lrs 3e-5 1e-4 3e-4 1e-3 --steps 40        # the LR sweep (naive GRPO)
    .venv/bin/python bench/ablation.py probe --steps 8                                   # seconds per step, projection

Task: ``recipes/chain_mix_cpu.yaml`` (``data/chain_mix.py``): chains of 2–6 digits folded as x = |x − d|, answered
directly (short, often wrong on long chains) or written out step by step (longer, reliable, inside L_max − L_cache). One supervised warm start,
selected on the dev split (``data.synthetic_eval_split=dev``), is shared by every rung and seed; it is measured first
(``bench/ablation_toy.py``: lengths, accuracy per difficulty, group kinds → ``ablation-toy-<date>.md``). Each rung then
trains ``--steps`` RL steps from it with ``--seeds`` seeds (the seeds vary RL's sampling and prompt order), the LR
warming up over 10 steps and decaying (cosine, to lr/10) over the run, at the one ``--lr`` the sweep chose. Held-out
eval: avg@4 at T = 1 on the eval split, never trained or selected on, every 20 steps.

Rungs (cumulative, in the paper's order): naive GRPO (clip 0.2/0.2, sequence-mean loss, no shaping, no filtering, no
dynamic sampling) → + overlong filtering → + clip-higher (0.28) → + soft overlong punishment (in place of the
filtering, as DAPO's recipe) → + token-level loss → + dynamic sampling (= DAPO, the recipe). The dual clip (c = 10) is
on in every rung. Baseline: the warm start continued supervised on as many sequences as a rung trains on
(steps × B × G). Writes ``ablation-<date>.md`` / ``.json`` (mean ± std over seeds; for each rung vs the rung below,
whether the difference exceeds the seeds' spread) and ``ablation-<date>.png`` (accuracy, length, entropy, truncation,
kept-sample rate) to ``--out``. Runs ``--jobs`` trainings at a time, one thread each.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import ablation_toy  # noqa: E402

RECIPE = "chain_mix_cpu"
LADDER_LR = 1e-4  # chosen by `bench/ablation.py sweep` (bench/results/ablation-lr-sweep-*.md)
NAIVE = ["algo.eps_high=0.2", "algo.loss_agg=seq-mean-token-mean", "algo.overlong_penalty=false",
         "algo.overlong_filter=false", "algo.dynamic_sampling=false", "algo.gen_batch_prompts=32"]  # fmt: skip
CLIP, SOFT = "algo.eps_high=0.28", "algo.overlong_penalty=true"
RUNGS = [  # (name, overrides on top of chain_mix_cpu = full DAPO)
    ("naive GRPO", NAIVE),
    ("+ overlong filtering", [*NAIVE, "algo.overlong_filter=true"]),
    ("+ clip-higher", [*NAIVE, "algo.overlong_filter=true", CLIP]),
    ("+ soft overlong punishment", [*NAIVE, CLIP, SOFT]),
    ("+ token-level loss", [*NAIVE, CLIP, SOFT, "algo.loss_agg=token-mean"]),
    ("+ dynamic sampling (DAPO)", []),
]
EVAL_KEY = "eval/synthetic/chain_mix/avg@4"
TRAIN_KEYS = ("train/entropy", "train/response_len_mean", "train/truncated_frac", "train/ppo_kl")
SEEDS = [1234 + 17 * k for k in range(16)]


def dapo(args: list[str], log: Path, threads: int = 1, cmd: str = "train") -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    recipe = ["--recipe", RECIPE] if cmd == "train" else []
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", cmd, *recipe, *args], cwd=REPO, env=env,
                            stdout=f, stderr=subprocess.STDOUT).returncode  # fmt: skip
    if rc:
        raise SystemExit(f"dapo {cmd} {' '.join(args)} failed ({rc}); log {log}:\n{log.read_text()[-3000:]}")


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def warm_start(work: Path, threads: int) -> Path:
    """The shared warm start (a zero-step run saves it after its supervised warm-up), selected on the dev split."""
    ckpt = work / "warm" / "checkpoints" / "step_000000"
    if not (ckpt / "dapo_meta.json").exists():
        t0 = time.monotonic()
        dapo([f"train.seed={SEEDS[0]}", "train.steps=0", "data.synthetic_eval_split=dev", f"train.run_dir={work}",
              "train.name=warm"], work / "warm.log", threads=threads)  # fmt: skip
        print(f"warm start: {time.monotonic() - t0:.0f} s", flush=True)
    return ckpt


def rl_args(overrides: list[str], seed: int, ckpt: Path, steps: int, lr: float, work: Path, name: str) -> list[str]:
    return [f"train.seed={seed}", f"model.load={ckpt}", "train.supervised_warmup_steps=0", f"train.steps={steps}",
            f"train.lr={lr:g}", f"train.min_lr={lr / 10:g}", *overrides, f"train.run_dir={work}",
            f"train.name={name}"]  # fmt: skip


def run_all(jobs: list[tuple[str, list[str]]], work: Path, parallel: int, t0: float) -> None:
    """Each (name, args) as one `dapo train` with one thread, ``parallel`` at a time."""

    def one(job: tuple[str, list[str]]) -> None:
        name, args = job
        dapo(args, work / f"{name}.log")
        print(f"{name}: done at {(time.monotonic() - t0) / 60:.1f} min", flush=True)

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for f in [pool.submit(one, j) for j in jobs]:
            f.result()


# ----------------------------------------------------------------------------------------------------------------------
# the ladder


def ladder(args) -> None:
    work = Path(args.work or tempfile.mkdtemp(prefix="dapo_ablation_"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ckpt = warm_start(work, args.jobs)
    ablation_toy.measure(ckpt, work / "toy", threads=args.jobs)  # before any rung runs; report() reads its samples back
    seeds = SEEDS[: args.seeds]
    jobs = [(f"rung{k}-{s}", rl_args(o, s, ckpt, args.steps, args.lr, work, f"rung{k}-{s}"))
            for s in seeds for k, (_, o) in enumerate(RUNGS)]  # fmt: skip
    cfg = ablation_toy.load_config(RECIPE)
    sft_steps = args.steps * cfg.train.batch_prompts * cfg.algo.group_size // cfg.train.supervised_batch
    jobs += [(f"sft-{s}", [f"train.seed={s}", f"model.load={ckpt}", "train.steps=0",
                           f"train.supervised_warmup_steps={sft_steps}", "train.supervised_stop_acc=2.0",
                           f"train.run_dir={work}", f"train.name=sft-{s}"]) for s in seeds]  # fmt: skip
    run_all(jobs, work, args.jobs, t0)
    settings = dict(seconds=time.monotonic() - t0, steps=args.steps, lr=args.lr, jobs=args.jobs, sft_steps=sft_steps,
                    seeds=args.seeds)  # fmt: skip
    (work / "ladder.json").write_text(json.dumps(settings))
    report(argparse.Namespace(work=str(work), out=args.out, jobs=args.jobs))


def report(args) -> None:
    """The report (table, curves, toy) from a finished ladder's work directory, with the settings it ran with."""
    work = Path(args.work)
    settings = json.loads((work / "ladder.json").read_text())
    toy = ablation_toy.measure(work / "warm" / "checkpoints" / "step_000000", work / "toy", threads=args.jobs)
    s = summarize(work, SEEDS[: settings.pop("seeds")], toy)
    s.update(settings)
    write(s, Path(args.out), work)


def _curve(r: list[dict], key: str) -> list[tuple[int, float]]:
    return [(x["step"], x[key]) for x in r if key in x and x["step"] >= 1]


def summarize(work: Path, seeds: list[int], toy: dict) -> dict:
    cfg = ablation_toy.load_config(RECIPE)
    per_step = cfg.train.batch_prompts * cfg.algo.group_size
    out = {}
    for k, (name, _) in enumerate(RUNGS):
        runs = []
        for seed in seeds:
            r = rows(work / f"rung{k}-{seed}")
            steps = [x for x in r if "train/entropy" in x]
            tail = steps[-10:]
            generated = sum(x["train/samples_generated"] for x in steps)
            runs.append({
                "final": _curve(r, EVAL_KEY)[-1][1],
                "mean_eval": statistics.mean(y for _, y in _curve(r, EVAL_KEY)),  # how fast it climbs
                "eval": _curve(r, EVAL_KEY),
                **{key.split("/")[1]: statistics.mean(x[key] for x in tail) for key in TRAIN_KEYS},
                "ppo_kl_max": max(x["train/ppo_kl"] for x in steps),
                # the share of tokens the upper / lower clip bound cut, over the whole run: clip-higher acts only there
                "clip_high_run": statistics.mean(x["train/clip_frac_high"] for x in steps),
                "clip_low_run": statistics.mean(x["train/clip_frac_low"] for x in steps),
                "kept_rate": len(steps) * per_step / generated,
                "dropped_all_correct": sum(x.get("train/dropped_all_correct", 0) for x in steps),
                "dropped_all_wrong": sum(x.get("train/dropped_all_wrong", 0) for x in steps),
                "steps": len(steps), "seconds": sum(x["time/step_s"] for x in steps),
                "curves": {key: _curve(r, key) for key in TRAIN_KEYS},
                "kept_curve": [(x["step"], per_step / x["train/samples_generated"]) for x in steps],
            })  # fmt: skip
        out[name] = runs
    sft = [rows(work / f"sft-{s}")[-1][EVAL_KEY] for s in seeds]
    return {"rungs": out, "sft": sft, "start": toy["eval"]["acc"], "toy": toy, "seeds": seeds}


def _ms(xs: list[float], spec: str = ".3f") -> str:
    return f"{statistics.mean(xs):{spec}} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:{spec}}"


def compare(a: list[float], b: list[float]) -> dict:
    """b vs a (the rung below): the difference of the means, the seeds' spread (pooled std of one run) and the
    standard error of the difference; "exceeds" = |difference| > spread."""
    d = statistics.mean(b) - statistics.mean(a)
    sa, sb = (statistics.stdev(x) if len(x) > 1 else 0.0 for x in (a, b))
    spread = math.sqrt((sa**2 + sb**2) / 2)
    se = math.sqrt(sa**2 / len(a) + sb**2 / len(b))
    return {"diff": d, "spread": spread, "se": se, "exceeds": abs(d) > spread, "two_se": abs(d) > 2 * se}


def write(s: dict, out_dir: Path, work: Path) -> None:
    date = datetime.date.today().isoformat()
    stem, k = f"ablation-{date}", 2
    while (out_dir / f"{stem}.md").exists():  # an earlier ladder of the same day stays
        stem, k = f"ablation-{date}-{k}", k + 1
    toy = stem.replace("ablation-", "ablation-toy-")
    names = list(s["rungs"])
    lines = [
        f"# DAPO ablation ladder, chain_mix toy — {date}", "",
        f"Machine: {ablation_toy.machine()}; {len(s['seeds'])} seeds; {s['steps']} RL steps per rung at lr "
        f"{s['lr']:g} (warmup 10, cosine to lr/10 over the run); {s['jobs']} runs at a time, 1 thread each; "
        f"{s['seconds'] / 60:.1f} min in all. Warm start (selected on the dev split), held-out avg@4: "
        f"{s['start']:.3f}. Toy at the warm start: [{toy}.md]({toy}.md).", "",
        "| rung | held-out avg@4 | vs rung below (Δ, seed spread) | mean of its evals | entropy | response length | "
        "truncated | "
        "ppo_kl (max) | clipped tokens, high / low | kept / generated | all-correct / all-wrong groups dropped | "
        "RL min per run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    comparisons = {}
    for i, name in enumerate(names):
        runs = s["rungs"][name]
        finals = [r["final"] for r in runs]
        cmp = ""
        if i:
            c = compare([r["final"] for r in s["rungs"][names[i - 1]]], finals)
            comparisons[name] = c
            verdict = "exceeds" if c["exceeds"] else "within"
            cmp = f"{c['diff']:+.3f}, {c['spread']:.3f}: {verdict}{' (> 2 SE)' if c['two_se'] else ''}"
        dropped = (f"{statistics.mean(r['dropped_all_correct'] for r in runs):.0f} / "
                   f"{statistics.mean(r['dropped_all_wrong'] for r in runs):.0f}") if "DAPO" in name else ""  # fmt: skip
        lines.append(
            f"| {name} | {_ms(finals)} | {cmp} | {_ms([r['mean_eval'] for r in runs])} | {_ms([r['entropy'] for r in runs])} | "
            f"{_ms([r['response_len_mean'] for r in runs], '.1f')} | {_ms([r['truncated_frac'] for r in runs])} | "
            f"{statistics.mean(r['ppo_kl_max'] for r in runs):.1e} | "
            f"{statistics.mean(r['clip_high_run'] for r in runs):.1e} / {statistics.mean(r['clip_low_run'] for r in runs):.1e} | "
            f"{_ms([r['kept_rate'] for r in runs], '.2f')} | "
            f"{dropped} | {statistics.mean(r['seconds'] for r in runs) / 60:.1f} |"
        )
    top = [r["final"] for r in s["rungs"][names[-1]]]
    c = compare(top, s["sft"])
    lines += [
        f"| supervised only ({s['sft_steps']} steps × 128 = the sequences a rung trains on) | {_ms(s['sft'])} | "
        f"vs DAPO {c['diff']:+.3f}, {c['spread']:.3f}: {'exceeds' if c['exceeds'] else 'within'} | | | | | | | | | |",
        "",
        "Entropy, length, truncation: means over each run's last 10 steps; ± is the std over seeds. \"vs rung below\": the "
        "difference of the means, the seeds' spread (pooled std of one run), and whether |Δ| exceeds it (> 2 SE: also "
        "more than twice the standard error of the difference). Mean of its evals: the held-out avg@4 averaged over "
        "the run's evaluations (every 20 steps), a measure of how fast a rung climbs. Dropped groups: per run, over all "
        "its steps. Clipped tokens: the share of tokens whose ratio the upper (1 + eps_high) or lower (1 − eps_low) bound "
        "cut, averaged over the run.",
        "", f"![curves]({stem}.png)",
    ]  # fmt: skip
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.md").write_text(text)
    (out_dir / f"{toy}.md").write_text(
        ablation_toy.report(s["toy"], f"# The ablation toy (chain_mix) at its warm start — {date}",
                            f"Machine: {ablation_toy.machine()}. Checkpoint: the ladder's warm start ({work})."))  # fmt: skip
    slim = {k: v for k, v in s.items() if k != "toy"}
    (out_dir / f"{stem}.json").write_text(json.dumps({"date": date, **slim, "comparisons": comparisons}))
    plot(s, out_dir / f"{stem}.png")


def plot(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [("held-out avg@4", "eval"), ("response length", "train/response_len_mean"),
              ("entropy", "train/entropy"), ("truncated fraction", "train/truncated_frac"),
              ("kept / generated samples", "kept"), ("ppo_kl", "train/ppo_kl")]  # fmt: skip
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, key) in zip(axes.flat, panels):
        for i, (name, runs) in enumerate(s["rungs"].items()):
            curves = [[(0, s["start"]), *r["eval"]] if key == "eval" else r["kept_curve"] if key == "kept"
                      else r["curves"][key] for r in runs]  # fmt: skip
            n = min(len(c) for c in curves)
            xs = [x for x, _ in curves[0][:n]]
            ys = np.array([[y for _, y in c[:n]] for c in curves])
            if key != "eval" and n > 5:  # a 5-step running mean
                ys = np.array([np.convolve(y, np.ones(5) / 5, mode="valid") for y in ys])
                xs = xs[4:]
            m, sd = ys.mean(0), ys.std(0)
            ax.plot(xs, m, color=f"C{i}", label=name)
            ax.fill_between(xs, m - sd, m + sd, color=f"C{i}", alpha=0.15)
        if key == "eval":
            ax.axhline(s["start"], color="black", ls=":", label="warm start")
            ax.axhline(statistics.mean(s["sft"]), color="gray", ls="--", label="supervised only")
            ax.legend(fontsize=7)
        if key == "train/ppo_kl":
            ax.set_yscale("log")
        ax.set(title=title, xlabel="RL step")
    fig.suptitle("DAPO ablation ladder (chain_mix toy): mean over seeds ± std")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------------------------------------------------
# the LR sweep and the timing probe


def sweep(args) -> None:
    """Naive GRPO from the warm start at each LR, constant after the warmup (the peak the ladder would see): per-step
    ppo_kl, held-out accuracy. The ladder's LR: the largest whose ppo_kl stays around 1e-3 and whose accuracy holds."""
    work = Path(args.work or tempfile.mkdtemp(prefix="dapo_lr_sweep_"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ckpt = warm_start(work, args.jobs)
    start = ablation_toy.measure(ckpt, work / "toy", threads=args.jobs)["eval"]["acc"]
    seeds = SEEDS[: args.seeds]
    names = {(lr, s): f"lr{lr:g}-{s}" for lr in args.lrs for s in seeds}
    jobs = [(n, [*rl_args(NAIVE, s, ckpt, args.steps, lr, work, n)[:-2], "train.min_lr=null", "eval.interval=10",
                 f"train.run_dir={work}", f"train.name={n}"]) for (lr, s), n in names.items()]  # fmt: skip
    run_all(jobs, work, args.jobs, t0)
    lines = [f"# LR sweep for the ablation ladder (naive GRPO, chain_mix) — {datetime.date.today().isoformat()}", "",
             f"Machine: {ablation_toy.machine()}; {args.steps} steps per run, warmup 10 then constant; seeds "
             f"{seeds}; warm start held-out avg@4 {start:.3f}; {(time.monotonic() - t0) / 60:.1f} min.", "",
             "| lr | ppo_kl median / max | held-out avg@4 (steps 10, 20, ...) | response length (last 5) | entropy |",
             "|---|---|---|---|---|"]  # fmt: skip
    for lr in args.lrs:
        for s in seeds:
            r = rows(work / names[(lr, s)])
            st = [x for x in r if "train/ppo_kl" in x]
            kl = [x["train/ppo_kl"] for x in st]
            ev = ", ".join(f"{y:.3f}" for _, y in _curve(r, EVAL_KEY))
            lines.append(f"| {lr:g} (seed {s}) | {statistics.median(kl):.1e} / {max(kl):.1e} | {ev} | "
                         f"{statistics.mean(x['train/response_len_mean'] for x in st[-5:]):.1f} | "
                         f"{statistics.mean(x['train/entropy'] for x in st[-5:]):.3f} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"ablation-lr-sweep-{datetime.date.today().isoformat()}.md").write_text(text)


def probe(args) -> None:
    """The slowest and the fastest rung (DAPO, naive GRPO) for a few steps, ``--jobs`` at a time: seconds per step
    and the ladder's projected wall time."""
    work = Path(args.work or tempfile.mkdtemp(prefix="dapo_probe_"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ckpt = warm_start(work, args.jobs)
    warm = time.monotonic() - t0
    jobs = [(f"probe{k}", [*rl_args(RUNGS[k][1], SEEDS[0], ckpt, args.steps, LADDER_LR, work, f"probe{k}")[:-2],
                           "eval.interval=0", f"train.run_dir={work}", f"train.name=probe{k}"]) for k in (0, 5)]  # fmt: skip
    run_all(jobs, work, args.jobs, time.monotonic())
    per = {k: [x["time/step_s"] for x in rows(work / f"probe{k}") if "time/step_s" in x][1:] for k in (0, 5)}
    step_s = {k: statistics.mean(v) for k, v in per.items()}
    print(json.dumps({"warm_start_s": warm, "step_s": step_s}, indent=1))
    rung_s = [step_s[0]] * (len(RUNGS) - 1) + [step_s[5]]  # the DAPO rung generates more per step
    total = sum(rung_s) * args.ladder_steps * args.ladder_seeds / args.jobs
    print(
        f"projected ladder ({args.ladder_seeds} seeds x {len(RUNGS)} rungs x {args.ladder_steps} steps, "
        f"{args.jobs} at a time), RL steps only: {total / 60:.1f} min (+ warm start, evals, the supervised "
        "baseline; early steps only: later steps may be longer)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", default="ladder", choices=("ladder", "sweep", "probe", "report"))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100, help="RL steps per rung (sweep, probe: per run)")
    ap.add_argument("--lr", type=float, default=LADDER_LR)
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-5, 1e-4, 3e-4, 1e-3], help="sweep: learning rates")
    ap.add_argument("--ladder-seeds", type=int, default=5, help="probe: the ladder it projects")
    ap.add_argument("--ladder-steps", type=int, default=100, help="probe: the ladder it projects")
    ap.add_argument("--jobs", type=int, default=2, help="trainings at a time (one thread each)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument(
        "--work", default=None, help="run directory (default: a new temporary one); its warm start is reused"
    )
    args = ap.parse_args()
    {"ladder": ladder, "sweep": sweep, "probe": probe, "report": report}[args.what](args)


if __name__ == "__main__":
    main()
