"""`dapo train --recipe demo_cpu_vllm` through the streaming schedule on the REAL vLLM CPU server: the trainer starts
the server from the actor's initial weights, the lanes generate ahead of the trainer across steps, every sync is
verified (pause, reload, checksums, resume), and the run ends with its server stopped. (What a sync interrupts keeps
its tokens: test_vllm.py's abort test; the tiny model's answers are too short to be caught in flight here.)"""

from __future__ import annotations

import psutil
import pytest

from tests.e2e.test_trainer import BASE, dapo, metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_streaming_schedule_on_the_real_vllm_server(tmp_path):
    dapo("train", "--recipe", "demo_cpu_vllm", *BASE, "train.steps=3", "rollout.schedule=stream",
         "rollout.stream_staleness=0.5", "algo.gen_batch_prompts=12", f"train.run_dir={tmp_path}",
         "train.name=stream", "train.save_interval=0", "train.export_hf=false")  # fmt: skip
    run = tmp_path / "stream"
    rows = {r["step"]: r for r in metrics(run)}
    assert sorted(rows) == [1, 2, 3]
    assert rows[1]["rollout/version_lag_max"] == 0.0
    assert 1e-5 < rows[1]["train/logp_gap_mean"] < 0.05  # bf16 server, fp32 actor, the same weights
    for s in (2, 3):
        assert rows[s]["train/kept_groups"] == 8 and rows[s]["sync/tensors"] == 26
        assert rows[s]["rollout/stale_samples"] > 0 and rows[s]["train/tis_token_frac"] > 0  # generated ahead
    assert "rollout/interrupted_samples_total" in rows[3]
    assert (run / "vllm_init" / "config.json").is_file(), "the server starts from the actor's initial weights"
    log = (run / "vllm" / "vllm_server.log").read_text()
    assert log.count("POST /pause") == log.count("POST /resume") == 4  # the initial sync and one per step
    assert log.count("POST /collective_rpc") == 8, "each sync: reload_weights, then the checksums read back"
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, f"the run left its server running: {leftovers}"
