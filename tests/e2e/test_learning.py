"""DAPO improves the policy: a short `dapo train` from a committed warm start raises held-out accuracy.

The warm start (``tests/data/add2_warm_start``, 2 MB, no optimizer state) is the demo's supervised warm start
(``dapo train --recipe demo_cpu train.steps=0``, seed 1234: 0.36 avg@4). The run is the demo recipe itself (G = 8, 64
kept groups per step with dynamic sampling, clip 0.2/0.28, token-level loss, AdamW 1e-3 warming up over 10 steps,
cosine to 1e-4 over the run) with train.steps = 60; held-out accuracy is the demo's eval (avg@4 of T = 1 samples on the 200 held-out
problems). Step 0's eval is the warm start itself (one supervised step at lr 0 evaluates it, as the demo logs its warm
start).

Measured (2 CPU cores shared with other jobs, 2026-12-01), avg@4 at step 0 -> 20 -> 40 -> 60, by ``train.seed``:
seed 1: 0.365 -> 0.258 -> 0.372 -> 0.527 (+0.162); seed 2: 0.376 -> 0.245 -> 0.364 -> 0.490 (+0.114); seed 3:
0.371 -> 0.280 -> 0.365 -> 0.505 (+0.134). Accuracy dips first (fresh Adam), then climbs, as in the demo; MARGIN =
0.08 is 70% of the smallest rise. The test runs seed 1. At 20 or 40 steps no seed had risen yet (nor did 40 steps at
lr 3e-4; lr 1e-3 without warmup collapses the policy in one step), hence 60. Wall clock: 430 s under a load average
of ~30-70 on 2 cores; on a quiet one ~1 min is expected (the demo's 0.8 s per step). A flipped advantage sign fails
it (the policy collapses).
"""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, repo_pythonpath

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WARM_START = REPO / "tests" / "data" / "add2_warm_start"
MARGIN = 0.08
KEY = "eval/synthetic/add2/avg@4"


def test_dapo_raises_held_out_accuracy_from_the_warm_start(tmp_path):
    args = [f"model.load={WARM_START}", "train.supervised_warmup_steps=1", "train.supervised_lr=0.0",
            "train.steps=60", "eval.interval=60", "train.save_interval=0", "train.export_hf=false", "train.seed=1",
            f"train.run_dir={tmp_path}", "train.name=learn"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": repo_pythonpath()}
    proc = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", "train", "--recipe", "demo_cpu", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=850)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "learn" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r[KEY] for r in rows if KEY in r}
    assert sorted(evals) == [0, 60], evals
    assert rows[0]["sft/steps"] == 1  # step 0: the warm start, evaluated unchanged (lr 0)
    assert evals[60] >= evals[0] + MARGIN, f"held-out avg@4 {evals[0]:.3f} -> {evals[60]:.3f} after 60 DAPO steps"
    assert rows[-1]["train/skipped_updates"] == 0
