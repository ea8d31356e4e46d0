"""bench/ablation.py's summary, table and curves from runs' metrics (fake ones: the ladder itself takes most of an hour,
so its last minute is checked here), and bench/ablation_toy.py's statistics of scored samples."""

import argparse
import json
import sys

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "bench"))
import ablation  # noqa: E402
import ablation_toy  # noqa: E402


def _samples() -> list[dict]:
    """Two problems x 4: a 2-term one all correct (direct), a 5-term one mixed (written, one truncated)."""
    out = []
    for j in range(4):
        out.append({"problem_id": 0, "prompt": "<bos>Q: 3 4=", "response": " Answer: 7", "finish_reason": "stop",
                    "acc": True})  # fmt: skip
        long = " 1 2 3 4 5 6 7 8 9 10 11 12 13 14" if j == 3 else " 1 3 6 10 15 Answer: 15"
        out.append({"problem_id": 1, "prompt": "<bos>Q: 1 2 3 4 5=", "response": long,
                    "finish_reason": "length" if j == 3 else "stop", "acc": j < 2})  # fmt: skip
    return out


def test_toy_statistics():
    s = ablation_toy.stats(_samples(), l_max=40, l_cache=8)
    assert s["samples"] == 8 and s["acc"] == pytest.approx(6 / 8)
    assert s["direct_share"] == 0.5 and s["truncated"] == 1 / 8
    assert s["by_terms"][2]["acc_direct"] == 1.0 and s["by_terms"][5]["acc_written"] == pytest.approx(2 / 4)
    assert s["length_max"] == 33 and s["in_cache_window"] == 1 / 8  # 33 characters, no eos: in (32, 40]
    assert s["groups"]["all"] == {"all_wrong": 0.0, "all_correct": 0.5, "mixed": 0.5}


def test_summary_table_and_curves_from_metrics(tmp_path, monkeypatch):
    seeds = ablation.SEEDS[:3]
    for k in range(len(ablation.RUNGS)):
        for i, seed in enumerate(seeds):
            lines = []
            for step in range(1, 41):
                row = {"step": step, "train/entropy": 0.3, "train/response_len_mean": 15.0 + k, "train/ppo_kl": 1e-3,
                       "train/truncated_frac": 0.01, "train/samples_generated": 256 * (2 if k == 5 else 1),
                       "time/step_s": 1.5, "train/dropped_all_correct": 3 * (k == 5),
                       "train/clip_frac_high": 1e-3 * k, "train/clip_frac_low": 2e-3}  # fmt: skip
                if step % 20 == 0:
                    row[ablation.EVAL_KEY] = 0.4 + 0.05 * k + 0.01 * i
                lines.append(json.dumps(row))
            (tmp_path / f"rung{k}-{seed}").mkdir()
            (tmp_path / f"rung{k}-{seed}" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for seed in seeds:
        (tmp_path / f"sft-{seed}").mkdir()
        (tmp_path / f"sft-{seed}" / "metrics.jsonl").write_text(json.dumps({"step": 0, ablation.EVAL_KEY: 0.5}) + "\n")
    toy = {"l_max": 40, "l_cache": 8, "group_size": 4}
    toy["train"] = toy["eval"] = ablation_toy.stats(_samples(), 40, 8)
    # `ablation.py report --work DIR`: the ladder's settings from its ladder.json, the toy measured at its warm start
    (tmp_path / "ladder.json").write_text(json.dumps({"seconds": 60.0, "steps": 40, "lr": 1e-4, "jobs": 2,
                                                      "sft_steps": 80, "seeds": 3}))  # fmt: skip
    monkeypatch.setattr(ablation_toy, "measure", lambda ckpt, work, threads: toy)
    ablation.report(argparse.Namespace(work=str(tmp_path), out=str(tmp_path / "out"), jobs=2))
    (md,) = (tmp_path / "out").glob("ablation-2*.md")
    text = md.read_text()
    assert "| naive GRPO | 0.410 ± 0.010 |  | 0.410 ± 0.010 |" in text
    assert "| + overlong filtering | 0.460 ± 0.010 | +0.050, 0.010: exceeds (> 2 SE) |" in text
    assert (
        "| 1.0e-03 | 5.0e-03 / 2.0e-03 | 0.50 ± 0.00 | 120 / 0 |" in text
    )  # ppo_kl max, clipped high / low  # DAPO: half the generated samples kept; 40 steps x 3 dropped
    assert (tmp_path / "out" / md.name.replace(".md", ".png")).stat().st_size > 10_000
    assert (tmp_path / "out" / md.name.replace("ablation-", "ablation-toy-")).exists()
