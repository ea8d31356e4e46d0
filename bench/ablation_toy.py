"""The ablation toy measured at a warm start, before any rung is run (issue 25, Build 1).

    .venv/bin/python bench/ablation_toy.py --load RUN/checkpoints/step_000000 [--problems 256] [--out bench/results]

Samples G = 8 responses at T = 1 (the rollout's settings: ``recipes/chain_mix_cpu.yaml``) for ``--problems``
train-split problems (what RL trains on) and 4 for each eval-split problem, with ``dapo eval``, and reports: response
lengths (percentiles against L_max − L_cache and L_max, truncated share), accuracy per number of terms and per style
(direct / written out), and the share of all-wrong, all-correct and mixed groups of G. Writes
``ablation-toy-<date>.md`` and ``.json`` to ``--out``. ``bench/ablation.py`` calls :func:`measure` on its warm start.
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
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from megatron_dapo.config.run_config import load_config  # noqa: E402
from megatron_dapo.data.chain_mix import held_out_rows, train_rows  # noqa: E402
from megatron_dapo.data.dataset import write_parquet_atomic  # noqa: E402

RECIPE = "chain_mix_cpu"
PROBE_SEED = 99  # the train-split problems probed (any train problem is one RL may draw)


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    return f"{platform.machine()} ({cpu}), {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"


def sample(
    load: Path, parquet: Path, n: int, out: Path, threads: int = 1, overrides: tuple[str, ...] = ()
) -> list[dict]:
    """``dapo eval`` of checkpoint ``load`` on ``parquet``, ``n`` samples per problem: the scored samples."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "eval", "--recipe", RECIPE, "--load", str(load), "--data",
           str(parquet), "--n", str(n), "--samples-out", str(out), f"train.run_dir={out.parent}", *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in out.read_text().splitlines()]


def _tokens(s: dict) -> int:
    """Response tokens as the trainer counts them (char tokenizer: one per character, + the eos when it stopped)."""
    return len(s["response"]) + (s["finish_reason"] == "stop")


def _terms(s: dict) -> int:
    return len(s["prompt"].split("Q: ")[-1].rstrip("=").split())


def stats(samples: list[dict], l_max: int, l_cache: int) -> dict:
    lengths = np.array([_tokens(s) for s in samples])
    out: dict = {
        "samples": len(samples),
        "length_percentiles": {f"p{q}": float(np.percentile(lengths, q)) for q in (10, 25, 50, 75, 90, 99)},
        "length_mean": float(lengths.mean()),
        "length_max": int(lengths.max()),
        "in_cache_window": float(((lengths > l_max - l_cache) & (lengths <= l_max)).mean()),
        "truncated": float(np.mean([s["finish_reason"] == "length" for s in samples])),
        "acc": float(np.mean([s["acc"] for s in samples])),
        "direct_share": float(np.mean([s["response"].lstrip().startswith("Answer") for s in samples])),
    }
    by: dict = defaultdict(list)
    for s in samples:
        style = "direct" if s["response"].lstrip().startswith("Answer") else "written"
        by[(_terms(s), "all")].append(s["acc"])
        by[(_terms(s), style)].append(s["acc"])
        by[(_terms(s), f"len_{style}")].append(_tokens(s))
    out["by_terms"] = {
        k: {"acc": statistics.mean(by[(k, "all")]), "n": len(by[(k, "all")]),
            **{f"acc_{st}": statistics.mean(by[(k, st)]) if by[(k, st)] else None for st in ("direct", "written")},
            **{f"share_{st}": len(by[(k, st)]) / len(by[(k, "all")]) for st in ("direct", "written")},
            **{f"len_{st}": statistics.mean(by[(k, f"len_{st}")]) if by[(k, f"len_{st}")] else None
               for st in ("direct", "written")}}
        for k in sorted({k for k, _ in by})
    }  # fmt: skip
    groups: dict = defaultdict(list)
    for s in samples:
        groups[s["problem_id"]].append(s)
    kinds: dict = defaultdict(lambda: defaultdict(int))
    for g in groups.values():
        c = sum(s["acc"] for s in g)
        kind = "all_wrong" if c == 0 else "all_correct" if c == len(g) else "mixed"
        kinds["all"][kind] += 1
        kinds[_terms(g[0])][kind] += 1
    out["groups"] = {k: {kind: v[kind] / sum(v.values()) for kind in ("all_wrong", "all_correct", "mixed")}
                     for k, v in kinds.items()}  # fmt: skip
    out["groups_n"] = len(groups)
    return out


def measure(load: Path, work: Path, problems: int = 256, threads: int = 1, overrides: tuple[str, ...] = ()) -> dict:
    """The toy's distributions at checkpoint ``load``: ``train`` (G samples of ``problems`` train problems) and
    ``eval`` (eval.n samples of every eval problem)."""
    cfg = load_config(RECIPE, list(overrides))
    work.mkdir(parents=True, exist_ok=True)
    l_max, l_cache = cfg.rollout.sampling.max_new_tokens, cfg.algo.overlong_cache
    probe = list({r["prompt"][0]["content"]: r for r in train_rows(problems, PROBE_SEED, cfg.data.chain_max_terms)}
                 .values())  # distinct problems (two-term sums repeat)  # fmt: skip
    evals = held_out_rows("eval", cfg.data.synthetic_eval_size, cfg.data.chain_max_terms)
    out = {"l_max": l_max, "l_cache": l_cache, "group_size": cfg.algo.group_size}
    for name, rows, n in (("train", probe, cfg.algo.group_size), ("eval", evals, cfg.eval.n)):
        done = work / f"toy-{name}.jsonl"  # a rerun with the same work directory reuses its samples
        if done.exists():
            samples = [json.loads(line) for line in done.read_text().splitlines()]
        else:
            samples = sample(
                load, write_parquet_atomic(rows, work / f"toy-{name}.parquet"), n, done, threads, overrides
            )
        out[name] = stats(samples, l_max, l_cache)
    return out


def report(m: dict, title: str, extra: str = "") -> str:
    t, lm, lc = m["train"], m["l_max"], m["l_cache"]
    p = t["length_percentiles"]
    lines = [
        title, "", extra, "",
        f"Train-split problems: {m['train']['groups_n']} × G = {m['group_size']} samples at T = 1; eval split: "
        f"{m['eval']['groups_n']} problems × {m['eval']['samples'] // max(m['eval']['groups_n'], 1)}.", "",
        f"**Response length** (tokens, eos included), L_max − L_cache = {lm - lc}, L_max = {lm}: "
        + ", ".join(f"{k} {v:.0f}" for k, v in p.items())
        + f", max {t['length_max']}, mean {t['length_mean']:.1f}; in the cache window ({lm - lc}, {lm}]: "
        f"{t['in_cache_window']:.1%}; truncated at L_max: {t['truncated']:.1%}. Direct answers: "
        f"{t['direct_share']:.1%} of the samples.", "",
        "| terms | samples | accuracy | direct: share, acc, length | written out: share, acc, length | groups all-wrong "
        "/ all-correct / mixed |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    f = lambda x, spec: "–" if x is None else format(x, spec)  # noqa: E731
    for k, r in t["by_terms"].items():
        g = t["groups"][k]
        lines.append(
            f"| {k} | {r['n']} | {r['acc']:.3f} | {r['share_direct']:.2f}, {f(r['acc_direct'], '.3f')}, "
            f"{f(r['len_direct'], '.1f')} | {r['share_written']:.2f}, {f(r['acc_written'], '.3f')}, "
            f"{f(r['len_written'], '.1f')} | {g['all_wrong']:.2f} / {g['all_correct']:.2f} / {g['mixed']:.2f} |"
        )
    g = t["groups"]["all"]
    lines.append(f"| all | {t['samples']} | {t['acc']:.3f} | {t['direct_share']:.2f} | {1 - t['direct_share']:.2f} | "
                 f"{g['all_wrong']:.2f} / {g['all_correct']:.2f} / {g['mixed']:.2f} |")  # fmt: skip
    e = m["eval"]
    lines += ["", f"Eval split (held out, never trained or selected on): avg@{m['eval']['samples'] // e['groups_n']} "
              f"{e['acc']:.3f}; per number of terms: "
              + ", ".join(f"{k}: {r['acc']:.3f}" for k, r in e["by_terms"].items())
              + f"; response length p50 {e['length_percentiles']['p50']:.0f}, p90 {e['length_percentiles']['p90']:.0f}, "
              f"truncated {e['truncated']:.1%}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", required=True, help="the warm start's checkpoint directory")
    ap.add_argument("--problems", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("overrides", nargs="*", help="recipe overrides (as the warm start had)")
    args = ap.parse_args()
    m = measure(Path(args.load), Path(tempfile.mkdtemp(prefix="dapo_toy_")), args.problems, args.threads,
                tuple(args.overrides))  # fmt: skip
    date = datetime.date.today().isoformat()
    text = report(m, f"# The ablation toy (chain_mix) at its warm start — {date}", f"Machine: {machine()}.")
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ablation-toy-{date}.md").write_text(text)
    (out / f"ablation-toy-{date}.json").write_text(json.dumps({"date": date, "machine": machine(), **m}, indent=2))


if __name__ == "__main__":
    main()
