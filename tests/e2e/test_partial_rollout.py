"""Partial rollout through the real trainer (megatron-core actor, HF engine): a SIGKILL in the middle of a step whose
carried samples are being resumed, then ``--resume auto``, trains every prompt exactly once, continues every carried
sample from the checkpoint, and matches an uninterrupted run's metrics exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_trainer import ENV, dapo, metrics
from tests.helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_NEW = 24
COMMON = ["algo.dynamic_sampling=false", "algo.group_size=4", "data.synthetic_train_size=400",
          "data.synthetic_eval_size=16", "eval.interval=0", "train.export_hf=false"]  # fmt: skip
# B = 1 kept group of 4 prompts a round, 4 groups per HF micro-batch: the groups after the cut are in flight when it
# comes (some of their samples still running): they are carried
PARTIAL = ["rollout.partial=true", "train.batch_prompts=1", "train.mini_batch_prompts=1", "algo.gen_batch_prompts=4",
           "rollout.hf.max_batch=16", f"rollout.sampling.max_new_tokens={MAX_NEW}", "train.supervised_warmup_steps=0",
           "train.steps=5", "train.save_interval=1", "train.keep_checkpoints=5"]  # fmt: skip


def partial_run(record: Path, kill_step: int, resume: str, *args: str) -> subprocess.Popen:
    """In the background, in its own process group; its output in ``record``.log."""
    cmd = [sys.executable, "-m", "tests.e2e.partial_run", str(record), str(kill_step), resume, *args]
    log = open(f"{record}.log", "w")  # noqa: SIM115 (a pipe nobody reads could fill and block the run)
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finished(proc: subprocess.Popen, record: Path) -> tuple[int, str]:
    """Its exit status, once its whole process group is gone (a SIGKILLed run leaves its forked children)."""
    code = proc.wait(timeout=600)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return code, Path(f"{record}.log").read_text()[-3000:]


def steps(record: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, record.read_text().splitlines())}


def test_sigkill_mid_partial_step_resumes_every_carried_sample_and_trains_each_prompt_once(tmp_path):
    # a model that has seen the answer format (20 supervised steps): it stops at varied lengths, some run on
    dapo("train", "--recipe", "demo_cpu", *COMMON, f"train.run_dir={tmp_path}", "train.name=init", "train.steps=0",
         "train.supervised_warmup_steps=20", "train.supervised_stop_acc=0.0")  # fmt: skip
    args = [*COMMON, *PARTIAL, f"train.run_dir={tmp_path}", f"model.load={tmp_path}/init/checkpoints/step_000000"]
    reference = partial_run(tmp_path / "straight.jsonl", 0, "none", *args, "train.name=straight")
    code, log = finished(partial_run(tmp_path / "killed.jsonl", 4, "none", *args, "train.name=killed"),
                         tmp_path / "killed.jsonl")  # fmt: skip
    assert code == -signal.SIGKILL, log  # killed itself mid-step 4 (see partial_run.py)
    assert (tmp_path / "killed" / "checkpoints" / "step_000003").is_dir()
    assert not (tmp_path / "killed" / "checkpoints" / "step_000004").exists()
    code, log = finished(partial_run(tmp_path / "resumed.jsonl", 0, "auto", *args, "train.name=killed"),
                         tmp_path / "resumed.jsonl")  # fmt: skip
    assert code == 0, log
    code, log = finished(reference, tmp_path / "straight.jsonl")
    assert code == 0, log

    straight, before, after = (steps(tmp_path / f) for f in ("straight.jsonl", "killed.jsonl", "resumed.jsonl"))
    assert sorted(before) == [1, 2, 3] and sorted(after) == [4, 5]  # killed in step 4, before its record
    # the carried samples of the step-3 checkpoint: there are some, and step 4 continues each of them, with the budget
    # it has left (prompt + partial response in, max_new_tokens - generated tokens)
    carried = after[4]["carried_in"]
    assert carried and carried == straight[4]["carried_in"]
    sent = {tuple(ids): budget for ids, budget in after[4]["requests"]}
    prompt_len = min(len(ids) for ids, _ in after[4]["requests"])  # a fresh prompt's (add2 prompts: one length)
    for ids in carried:
        assert sent.get(tuple(ids)) == MAX_NEW - (len(ids) - prompt_len), "a carried sample was not continued"
    # every prompt trained once: steps 1-3 of the killed run (checkpointed), 4-5 of the resumed one
    trained = [i for s in (before[1], before[2], before[3], after[4], after[5]) for i in s["trained"]]
    assert len(trained) == len(set(trained)) == 5
    assert trained == [i for s in sorted(straight) for i in straight[s]["trained"]]
    assert after[5]["prompt_cursor"] == straight[5]["prompt_cursor"]  # no prompt taken twice or skipped
    # and the resumed run IS the uninterrupted one
    ref = {r["step"]: r for r in metrics(tmp_path / "straight")}
    res = {r["step"]: r for r in metrics(tmp_path / "killed")}
    assert sum(ref[s]["rollout/resumed_samples"] for s in ref) > 0
    for step in (4, 5):
        for key, value in ref[step].items():
            if key.startswith(("train/", "rollout/")):
                assert res[step][key] == value, (step, key)
