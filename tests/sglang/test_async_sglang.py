"""`dapo train --recipe demo_cpu_sglang` with ``rollout.schedule=one_step_off`` and partial rollout (and ``stream``): the producer thread
drives the REAL SGLang CPU server over HTTP while the trainer trains; each step's batch after the first was generated
on the weights one version behind, the sync (verified, every step) waits for it, and the run ends with its server
stopped."""

from __future__ import annotations

import psutil
import pytest

from tests.e2e.test_trainer import BASE, dapo, metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_one_step_off_with_partial_rollout_on_the_real_server(tmp_path):
    dapo("train", "--recipe", "demo_cpu_sglang", *BASE, "train.steps=3", "rollout.schedule=one_step_off",
         "rollout.partial=true", "algo.gen_batch_prompts=12", f"train.run_dir={tmp_path}", "train.name=one_off")  # fmt: skip
    run = tmp_path / "one_off"
    rows = {r["step"]: r for r in metrics(run)}
    assert sorted(rows) == [1, 2, 3]
    assert [rows[s]["rollout/batch_lag"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    for s in (2, 3):
        assert rows[s]["rollout/version_lag_mean"] >= 1 and rows[s]["train/tis_token_frac"] == 1.0  # TIS on, auto
        assert rows[s]["train/kept_groups"] == 8 and rows[s]["sync/tensors"] == 26
    assert 1e-5 < rows[1]["train/logp_gap_mean"] < 0.05  # the on-policy first step: server and actor agree
    assert all(rows[s]["rollout/carried_groups"] == 4 for s in rows)  # the surplus (12 - 8 prompts) is kept
    assert rows[3]["rollout/version_lag_max"] >= 2  # carried groups from an older batch: lag 1 + their age
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, f"the run left its server running: {leftovers}"


def test_the_streaming_schedule_interrupts_the_real_server_at_each_sync(tmp_path):
    """rollout.schedule=stream: the lanes keep the server busy across steps, the sync aborts what is in flight (the
    samples resume on the new weights), every sync is verified, and the verl-style metrics are logged. With streaming
    training: π_old from the server, each of the 4 mini-batch updates started as its 2 groups are kept."""
    dapo("train", "--recipe", "demo_cpu_sglang", *BASE, "train.steps=3", "rollout.schedule=stream",
         "rollout.stream_staleness=0.5", "algo.gen_batch_prompts=12", f"train.run_dir={tmp_path}",
         "train.name=stream", "algo.old_logprobs=rollout", "train.stream_updates=true",
         "train.mini_batch_prompts=2")  # fmt: skip
    run = tmp_path / "stream"
    rows = {r["step"]: r for r in metrics(run)}
    assert sorted(rows) == [1, 2, 3]
    assert rows[1]["rollout/version_lag_max"] == 0.0  # the first batch: all on the initial weights
    for s in (2, 3):
        assert rows[s]["train/kept_groups"] == 8 and rows[s]["sync/tensors"] == 26
        assert rows[s]["rollout/stale_samples"] > 0 and rows[s]["train/tis_token_frac"] > 0  # generated ahead
        assert rows[s]["time/update_s"] > 0 and rows[s]["train/old_logprob_pass_seqs"] == 0  # streamed, no π_old pass
    for key in ("trainer_idle_ratio", "rollout_idle_ratio", "partial_ratio", "max_partial_span", "window_groups"):
        assert all(f"rollout/{key}" in rows[s] for s in rows), key
    assert "rollout/interrupted_samples_total" in rows[3] and rows[3]["rollout/window_groups"] == 18
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, f"the run left its server running: {leftovers}"
