"""MetricsLogger (JSONL append / resume / crash safety, tensorboard), eval metrics, pass@k, Timer."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_dapo.metrics import (
    METRICS_FILE,
    MetricsLogger,
    Timer,
    eval_metrics,
    majority_vote,
    pass_at_k,
    read_metrics,
)

REPO = Path(__file__).resolve().parents[2]


def _lines(run_dir: Path) -> list[dict]:
    text = (run_dir / METRICS_FILE).read_text()
    assert text == "" or text.endswith("\n"), "file must end on a complete line"
    return [json.loads(line) for line in text.splitlines()]  # raises on a torn line


# ----------------------------------------------------------------------------------------------------------------------
# JSONL logging


@pytest.mark.timeout(60)
def test_log_converts_values_and_reads_back(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(
            1,
            {
                "train/loss": torch.tensor(0.25),
                "train/lr": np.float32(1e-6),
                "train/kept_groups": np.int64(7),
                "train/grad_norm": torch.tensor([3.5], dtype=torch.bfloat16),
                "train/flag": True,
                "train/entropy": float("nan"),
                "time/step_s": 2,
            },
        )
        logger.log(2, {"train/loss": 0.125})
    raw = _lines(tmp_path)
    assert [r["step"] for r in raw] == [1, 2]
    assert raw[0]["train/entropy"] is None  # strict JSON: NaN written as null
    assert all(isinstance(v, float) for k, v in raw[0].items() if k not in ("step", "train/entropy"))
    recs = read_metrics(tmp_path)
    assert recs[0]["train/loss"] == 0.25
    assert recs[0]["train/lr"] == pytest.approx(1e-6, rel=1e-6)
    assert recs[0]["train/kept_groups"] == 7.0
    assert recs[0]["train/grad_norm"] == 3.5
    assert recs[0]["train/flag"] == 1.0
    assert math.isnan(recs[0]["train/entropy"])
    assert recs[1] == {"step": 2, "train/loss": 0.125}


@pytest.mark.timeout(60)
def test_log_rejects_bad_values_naming_the_key(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        with pytest.raises(ValueError, match="train/vec"):
            logger.log(1, {"train/vec": torch.ones(3)})
        with pytest.raises(ValueError, match="train/name"):
            logger.log(1, {"train/name": "abc"})
        with pytest.raises(ValueError, match="step"):
            logger.log(1.5, {"a": 1.0})
    assert _lines(tmp_path) == []  # nothing half-written


@pytest.mark.timeout(60)
def test_same_step_lines_are_merged_on_read(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(5, {"train/loss": 1.0})
        logger.log(5, {"eval/aime/avg@4": 0.5, "train/loss": 2.0})
        logger.log(3, {"train/loss": 3.0})
    assert read_metrics(tmp_path) == [
        {"step": 3, "train/loss": 3.0},
        {"step": 5, "train/loss": 2.0, "eval/aime/avg@4": 0.5},
    ]


@pytest.mark.timeout(60)
def test_resume_cuts_torn_line_and_later_steps(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for s in range(1, 7):
            logger.log(s, {"train/loss": float(s), "run": 1.0})
    with open(tmp_path / METRICS_FILE, "a") as f:  # a kill in the middle of step 7's write
        f.write('{"step": 7, "train/lo')
    # the checkpoint was written at step 4: steps 5, 6 (and the torn 7) are replayed by the resumed run
    with MetricsLogger(tmp_path, tensorboard=False, resume=4) as logger:
        assert _lines(tmp_path) == [{"step": s, "train/loss": float(s), "run": 1.0} for s in range(1, 5)]
        for s in range(5, 9):
            logger.log(s, {"train/loss": float(s), "run": 2.0})
    lines = _lines(tmp_path)
    steps = [r["step"] for r in lines]
    assert steps == list(range(1, 9)), steps  # no duplicates, no gaps
    assert [r["run"] for r in lines] == [1.0] * 4 + [2.0] * 4


@pytest.mark.timeout(60)
def test_resume_true_keeps_complete_lines_and_fresh_run_keeps_old_file_aside(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"a": 1.0})
        logger.log(2, {"a": 2.0})
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 3, "a": 3.0}')  # complete JSON but no newline: the write was cut before its end
    with MetricsLogger(tmp_path, tensorboard=False, resume=True) as logger:
        logger.log(3, {"a": 30.0})
    assert _lines(tmp_path) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}, {"step": 3, "a": 30.0}]
    with MetricsLogger(tmp_path, tensorboard=False) as logger:  # fresh run in the same directory
        logger.log(1, {"a": -1.0})
    assert _lines(tmp_path) == [{"step": 1, "a": -1.0}]
    prev = [json.loads(line) for line in (tmp_path / (METRICS_FILE + ".prev")).read_text().splitlines()]
    assert [r["a"] for r in prev] == [1.0, 2.0, 30.0]


@pytest.mark.timeout(60)
def test_read_metrics_skips_torn_tail_but_rejects_bad_middle_line(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a"')
    assert read_metrics(path) == [{"step": 1, "a": 1.0}]
    path.write_text('{"step": 1, "a": 1.0}\ngarbage\n{"step": 3, "a": 1.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(path)
    with pytest.raises(FileNotFoundError, match="nothere"):
        read_metrics(tmp_path / "nothere")


_WRITER = """
import sys
from megatron_dapo.metrics import MetricsLogger
logger = MetricsLogger(sys.argv[1], tensorboard=False)
payload = {f"train/m{i:03d}": i * 0.123456789 for i in range(200)}  # ~6 KB lines: kills land mid-line more often
step = 0
while True:
    step += 1
    logger.log(step, payload)
    if step == 20:
        print("ready", flush=True)
"""


@pytest.mark.timeout(120)
def test_sigkill_while_logging_then_resume(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    recs = read_metrics(tmp_path)  # tolerates a torn tail
    last = recs[-1]["step"]
    assert last >= 20 and [r["step"] for r in recs] == list(range(1, last + 1))
    with MetricsLogger(tmp_path, tensorboard=False, resume=last - 5) as logger:
        logger.log(last - 4, {"x": 1.0})
    assert [r["step"] for r in _lines(tmp_path)] == list(range(1, last - 3))


@pytest.mark.timeout(120)
def test_tensorboard_events_and_purge_on_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, config={"train": {"lr": 1e-6}}) as logger:
        for s in range(1, 5):
            logger.log(s, {"train/loss": 10.0 + s})
    with MetricsLogger(tmp_path, resume=2) as logger:
        for s in range(3, 5):
            logger.log(s, {"train/loss": 20.0 + s})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [(e.step, e.value) for e in events] == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0)]


def test_wandb_missing_is_a_clear_error(tmp_path):
    try:
        import wandb  # noqa: F401

        pytest.skip("wandb is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="wandb_project.*pip install wandb"):
        MetricsLogger(tmp_path, tensorboard=False, wandb_project="dapo")


# ----------------------------------------------------------------------------------------------------------------------
# Timer


def test_timer_adds_seconds_under_time_key():
    out: dict = {}
    with Timer("rollout", out) as t:
        time.sleep(0.05)
    assert t.key == "time/rollout_s" and out["time/rollout_s"] == t.seconds >= 0.05
    first = t.seconds
    with Timer("rollout", out) as t2:
        time.sleep(0.02)
    assert out["time/rollout_s"] == pytest.approx(first + t2.seconds)
    with Timer("sync") as t3:
        pass
    assert t3.seconds >= 0.0


# ----------------------------------------------------------------------------------------------------------------------
# Eval metrics


def _rec(source, pid, pred, acc, key="problem_id"):
    return {"data_source": source, key: pid, "pred": pred, "acc": acc}


def test_eval_metrics_hand_computed():
    a = {
        # tie 2-2 between "7" and "5": the first seen ("7", wrong) wins -> maj wrong; pass yes; 2/4 correct
        "p1": [("7", False), ("5", True), ("7", False), ("5", True)],
        # three invalid preds would out-vote "9" if they counted -> maj = "9", correct; 1/4 correct
        "p2": [(None, False), ("", False), ("  ", False), ("9", True)],
        # all wrong, majority "1" -> maj wrong, pass no; 0/4
        "p3": [("1", False), ("1", False), ("2", False), ("x", False)],
        # 3 of 4 right, majority right
        "p4": [("4", True), ("4", True), ("3", False), ("4", True)],
    }
    b = {  # keyed by prompt, k = 2
        "what is 1+1?": [("2", True), ("3", False)],  # tie: first seen "2" right
        "what is 2+2?": [(None, False), (None, False)],  # nothing valid: maj wrong
    }
    records = []
    for i in range(4):  # interleave problems and sources, as an eval loop would emit them
        for pid, samples in a.items():
            records.append(_rec("aime", pid, *samples[i]))
        if i < 2:
            for prompt, samples in b.items():
                records.append(_rec("math", prompt, *samples[i], key="prompt"))
    got = eval_metrics(records)
    want = {
        "eval/aime/avg@4": (2 + 1 + 0 + 3) / 16,
        "eval/aime/pass@4": 3 / 4,
        "eval/aime/maj@4": 2 / 4,  # p2, p4
        "eval/math/avg@2": 1 / 4,
        "eval/math/pass@2": 1 / 2,
        "eval/math/maj@2": 1 / 2,
    }
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v), k


def test_majority_vote_rules():
    assert majority_vote(["b", "a", "b", "a", "c"], [False, True, False, True, False]) == ("b", False)
    assert majority_vote([None, "", "z"], [False, False, True]) == ("z", True)
    assert majority_vote([None, None], [False, False]) == (None, False)
    assert majority_vote([3, "3", 4], [True, True, False]) == ("3", True)  # compared as strings


def test_eval_metrics_errors_name_the_culprit():
    recs = [_rec("aime", "p1", "1", True), _rec("aime", "p1", "1", True), _rec("aime", "p2", "1", True)]
    with pytest.raises(ValueError, match=r"'aime'.*different numbers of samples.*'p2'"):
        eval_metrics(recs)
    with pytest.raises(ValueError, match=r"record 1: missing key 'acc'"):
        eval_metrics([_rec("aime", "p1", "1", True), {"data_source": "aime", "problem_id": "p1"}])
    with pytest.raises(ValueError, match=r"record 0: needs 'problem_id' or 'prompt'"):
        eval_metrics([{"data_source": "aime", "pred": "1", "acc": True}])
    with pytest.raises(ValueError, match=r"record 0: acc = -1.0"):
        eval_metrics([_rec("aime", "p1", "1", -1.0)])
    assert eval_metrics([]) == {}


def _pass_at_k_brute(n: int, c: int, k: int) -> float:
    items = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(items[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_brute_force():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_brute(n, c, k), abs=1e-12), (n, c, k)
    assert pass_at_k(1024, 3, 1) == pytest.approx(3 / 1024)  # large n: exact integer arithmetic, no overflow
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


def test_pass_at_k_agrees_with_eval_metrics_at_k_equals_n():
    rng = np.random.default_rng(0)
    records, per_problem = [], []
    for p in range(20):
        accs = rng.random(8) < rng.random()
        per_problem.append(int(accs.sum()))
        records += [_rec("s", p, str(int(a)), bool(a)) for a in accs]
    got = eval_metrics(records)
    assert got["eval/s/pass@8"] == pytest.approx(np.mean([pass_at_k(8, c, 8) for c in per_problem]))
    assert got["eval/s/avg@8"] == pytest.approx(np.mean([pass_at_k(8, c, 1) for c in per_problem]))


def test_memory_metrics_see_this_process_and_a_child_holding_memory():
    """``mem/rss_peak_gib`` is this process's peak (it grows past a buffer we touch); ``mem/children_rss_gib`` counts
    a child process by what it holds (a child touching 300 MiB)."""
    from megatron_dapo.metrics import memory_metrics

    # The peak is a high-water mark, and Linux carries it across fork+exec (a child starts with pytest's peak), so
    # the child writes enough to pass the peak it inherited: its current RSS + that gap + 200 MiB (written pages, not
    # calloc'd zeros, so they are resident). Its peak must then pass the inherited one by ~200 MiB.
    peak = (
        "import json, psutil; from megatron_dapo.metrics import memory_metrics as m;"
        " start = m()['mem/rss_peak_gib']; now = psutil.Process().memory_info().rss / 2**30;"
        " buf = b'1' * int((start - now) * 2**30 + 200 * 2**20);"
        " print(json.dumps([start, now, m()['mem/rss_peak_gib']]))"
    )
    out = subprocess.run([sys.executable, "-c", peak], capture_output=True, text=True, check=True).stdout
    start, now, grown = json.loads(out.strip().splitlines()[-1])
    assert grown >= start + 0.15, (start, now, grown)
    before = memory_metrics()
    code = "import time; b = b'1' * (300 * 2**20); print('ok', flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ok"
        held = memory_metrics()["mem/children_rss_gib"]
        assert 0.29 <= held - before["mem/children_rss_gib"] < 1.0, held
    finally:
        child.kill()
        child.wait()
