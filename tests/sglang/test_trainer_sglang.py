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
