"""`dapo train --recipe demo_cpu_sglang`: the DAPO loop with the real SGLang server on CPU cores (start-up from the
actor's initial weights, rollouts, a verified tensor sync every step, eval), and the server stopped at the end."""

from __future__ import annotations

import psutil
import pytest

from tests.e2e.test_trainer import BASE, KEYS, dapo, metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_two_steps_on_the_real_server(tmp_path):
    dapo("train", "--recipe", "demo_cpu_sglang", *BASE, "train.supervised_warmup_steps=1", "train.steps=2",
         f"train.run_dir={tmp_path}", "train.name=sglang")  # fmt: skip
    run = tmp_path / "sglang"
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in KEYS:
        assert key in rows[-1], key
    assert rows[-1]["train/kept_groups"] == 8 and rows[-1]["sync/tensors"] == 26
    # bf16 server vs fp32 actor on the same, verified weights: small, but not the fp32 HF engine's ~1e-7
    assert 1e-5 < rows[-1]["train/logp_gap_mean"] < 0.05
    assert (run / "sglang_init" / "config.json").is_file(), "the server starts from the actor's initial weights"
    log = (run / "sglang" / "sglang_server.log").read_text()
    assert "--device cpu" in log and "update_weights_from_tensor" in log
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, f"the run left its server running: {leftovers}"


def test_colocated_loop_releases_trains_resumes_syncs_then_generates(tmp_path):
    """Issue 14's order, observed at the real server over 3 DAPO steps with rollout.colocate=true: generate, release
    (after an idle check), train, resume, sync, generate again. (The CPU server frees nothing: no memory saver.)"""
    import re

    dapo("train", "--recipe", "demo_cpu_sglang", *BASE, "rollout.colocate=true", "train.steps=3", "eval.interval=0",
         f"train.run_dir={tmp_path}", "train.name=phases")  # fmt: skip
    rows = metrics(tmp_path / "phases")
    assert [r["step"] for r in rows] == [1, 2, 3] and all("time/phase_to_train_s" in r for r in rows)
    text = (tmp_path / "phases" / "sglang" / "sglang_server.log").read_text()
    names = {"/generate": "generate", "/release_memory_occupation": "release", "/resume_memory_occupation": "resume",
             "/update_weights_from_tensor": "sync"}  # fmt: skip
    events = []
    for m in re.finditer(r'"POST (/\w+) HTTP/1.1" (\d+)', text):
        if m.group(1) in names:
            assert m.group(2) == "200", m.group(0)
            if not events or events[-1] != names[m.group(1)]:
                events.append(names[m.group(1)])
    # (the server's own warm-up request,) the initial sync, then per step: generate -> release -> (train) -> resume ->
    # sync; the last step's eval generates
    assert events[events.index("sync") :] == ["sync"] + ["generate", "release", "resume", "sync"] * 3 + ["generate"]
    assert set(events[: events.index("sync")]) <= {"generate"}, events
