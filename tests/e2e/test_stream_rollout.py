"""rollout.schedule=stream through the real trainer (megatron-core actor, HF engine generating in its lanes): three
SIGKILLs at moments picked at random (by samples delivered: in training, generating ahead, a sync or a save), each
followed by ``--resume auto``; every step's metrics equal an uninterrupted run's, and no prompt is lost or trained
twice.

What a streamed sample is depends on timing in one way only: which weights generated each of its tokens. So these
runs train at lr 1e-30 (Adam's steps fall below fp32's resolution: the weights never move, every version is the same
policy) and the samples become a function of the seed: a sample keeps its seed (the prompt's place in the data) and a
resumed one continues its random stream (``GenRequest.offset``), so an interrupted sample ends as if never cut. Then
everything computed from the trained batch (rewards, lengths, loss, entropy, clip fractions, gradient norm, ...) must
equal the uninterrupted run's, up to float noise from the lanes' batch shapes; what measures timing (``time/``,
``mem/``, throughput, the lanes' idle ratios and lag statistics, the count of interrupted samples) is not compared.
The age limit (``rollout.partial_max_age``) is lifted: which groups grow too old is timing too."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_partial_rollout import COMMON, finished
from tests.e2e.test_trainer import ENV
from tests.helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 12
STREAM = ["rollout.schedule=stream", "rollout.colocate=false", "rollout.stream_staleness=0.5", "train.batch_prompts=2",
          "train.mini_batch_prompts=2", "algo.gen_batch_prompts=4", "rollout.sampling.max_new_tokens=12",
          "train.supervised_warmup_steps=0", f"train.steps={STEPS}", "train.save_interval=1",
          "train.keep_checkpoints=2", f"rollout.partial_max_age={STEPS}", "train.lr=1e-30", "train.min_lr=0",
          "algo.overlong_penalty=true", "algo.overlong_cache=10"]  # fmt: skip
# measures of timing, not of the batch trained (logp_gap: measured on the tokens sampled on the trainer's version)
TIMING = ("time/", "mem/", "perf/tokens_per_s", "sync/seconds", "sync/verify_seconds", "rollout/", "train/tis_token_frac",
          "train/logp_gap_")  # fmt: skip


def stream_run(record: Path, kill_at: int, resume: str, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.e2e.stream_run", str(record), str(kill_at), resume, *args]
    log = open(f"{record}.log", "w")  # noqa: SIM115 (a pipe nobody reads could fill and block the run)
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def trained_by_step(*records: Path, what: str = "trained") -> dict[int, list]:
    """Per step, the prompts (or responses) of the last run that recorded it (a step re-run after a resume replaces
    the killed one's)."""
    out: dict[int, list] = {}
    for record in records:
        if record.exists():
            for row in map(json.loads, record.read_text().splitlines()):
                out[row["step"]] = row[what]
    return out


def test_three_sigkills_anywhere_lose_no_prompt_and_train_none_twice(tmp_path):
    args = [*COMMON, *STREAM, f"train.run_dir={tmp_path}"]
    code, log = finished(stream_run(tmp_path / "straight.jsonl", 0, "none", *args, "train.name=straight"),
                         tmp_path / "straight.jsonl")  # fmt: skip
    assert code == 0, log
    rng = random.Random(41)
    records, kills = [], 0
    for attempt in range(8):  # three kills, then a run to the end
        record = tmp_path / f"run{attempt}.jsonl"
        records.append(record)
        kill_at = rng.randint(28, 45) if kills < 3 else 0  # an uninterrupted run delivers ~110
        code, log = finished(stream_run(record, kill_at, "auto", *args, "train.name=killed"), record)
        if code == 0:
            break
        assert code == -signal.SIGKILL, log
        kills += 1
    assert kills == 3 and code == 0, log
    firsts = [min(trained_by_step(r), default=None) for r in records[1:]]
    assert sum(1 for f in firsts if f and f > 1) >= 2, firsts  # resumed from a checkpoint mid-run, not from scratch
    straight = trained_by_step(tmp_path / "straight.jsonl")
    resumed = trained_by_step(*records)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert [resumed[s] for s in sorted(resumed)] == [straight[s] for s in sorted(straight)]
    flat = [tuple(p) for s in sorted(resumed) for p in resumed[s]]
    assert len(set(flat)) == len(flat) == STEPS * 2  # B = 2 groups a step, each prompt once
    assert (tmp_path / "killed" / "checkpoints" / f"step_{STEPS:06d}").is_dir()
    # the tokens: an interrupted sample, resumed after a sync or from a checkpoint, ends as the uninterrupted one did
    assert trained_by_step(*records, what="responses") == trained_by_step(tmp_path / "straight.jsonl", what="responses")
    metrics = {}
    for run in ("straight", "killed"):
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        assert sum(r.get("rollout/dropped_stale_groups", 0) for r in rows) == 0, run  # the premises: none dropped,
        assert rows[-1]["rollout/resumed_samples_total"] > 0, run  # and samples resumed after an interruption
        metrics[run] = {r["step"]: r for r in rows if "train/loss" in r}  # the last row of a step re-run wins
    assert sorted(metrics["killed"]) == sorted(metrics["straight"]) == list(range(1, STEPS + 1))
    for step, want in metrics["straight"].items():
        got = metrics["killed"][step]
        keys = sorted(k for k in want if not k.startswith(TIMING))
        assert keys == sorted(k for k in got if not k.startswith(TIMING)), step
        assert len(keys) > 30
        for k in keys:
            assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6, nan_ok=True), (step, k)


def test_streamed_updates_on_two_data_parallel_ranks(tmp_path):
    """train.stream_updates under torchrun with DP 2: rank 0 scatters each mini-batch as its group is kept, both
    ranks run each update on their share, and a step is B groups trained in B / mini updates with no π_old pass."""
    from tests.e2e.test_trainer import dapo, metrics

    dapo("train", "--recipe", "demo_cpu", *COMMON, *STREAM[:3], "train.batch_prompts=4", "train.mini_batch_prompts=2",
         "algo.gen_batch_prompts=4", "train.supervised_warmup_steps=5", "train.steps=3", "algo.old_logprobs=rollout",
         "train.stream_updates=true", "parallel.tp=1", "rollout.sampling.max_new_tokens=12", "algo.overlong_penalty=true",
         "algo.overlong_cache=10", f"train.run_dir={tmp_path}", "train.name=dp2", nproc=2)  # fmt: skip
    rows = {r["step"]: r for r in metrics(tmp_path / "dp2") if r["step"] > 0}
    assert sorted(rows) == [1, 2, 3]
    for r in rows.values():
        assert r["train/kept_groups"] == 4 and r["train/old_logprob_pass_seqs"] == 0 and r["time/update_s"] > 0
        assert r["train/grad_norm"] >= 0 and r["train/loss"] == r["train/loss"]  # finite: the updates ran
    assert all(r["train/grad_norm"] > 0 for r in rows.values())  # overlong shaping varies the rewards: updates move
