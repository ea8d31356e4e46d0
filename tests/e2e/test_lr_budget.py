"""`dapo train` bounded by train.sample_budget with train.steps huge: the trainer feeds the samples it generates to the
LR schedule, so the LR decays over the budget (halfway after 1 of 2 steps, train.min_lr at the last) instead of staying
at its peak (the cosine over train.steps of issue 25)."""

import json
import math
import subprocess
import sys

import pytest

from tests.e2e.test_trainer import ENV
from tests.helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LR, MIN_LR = 1e-3, 1e-4


def test_sample_budget_run_decays_to_min_lr_at_its_end(tmp_path):
    args = ["train.supervised_warmup_steps=0", "algo.dynamic_sampling=false", "train.batch_prompts=8",
            "train.mini_batch_prompts=8", "algo.gen_batch_prompts=8", "algo.group_size=4",
            "data.synthetic_train_size=100", "data.synthetic_eval_size=8", "eval.interval=0", "eval.n=1",
            "train.save_interval=0", "train.export_hf=false", "train.warmup_steps=0", f"train.lr={LR}",
            f"train.min_lr={MIN_LR}", "train.steps=100000", "train.sample_budget=64",  # 2 steps of 8 x 4
            f"train.run_dir={tmp_path}", "train.name=budget"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "train", "--recipe", "demo_cpu", *args],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=280)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "budget" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/lr" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["train/samples_generated_total"] for r in rows] == [32, 64]
    halfway = MIN_LR + 0.5 * (math.cos(math.pi * 0.5) + 1) * (LR - MIN_LR)
    assert rows[0]["train/lr"] == pytest.approx(halfway, rel=1e-9)  # the LR of step 2's update
    assert rows[1]["train/lr"] == pytest.approx(MIN_LR, rel=1e-9)
