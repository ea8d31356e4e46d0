"""LoRA with adapter-only sync on the REAL SGLang 0.5.23 CPU server (``rollout.lora_sync = auto``: adapter on SGLang).

The server starts from the frozen base (the HF export unmerged) with ``--enable-lora``; each step the trainer sends
only the adapters (a PEFT folder, ``/load_lora_adapter``) and the requests name the new version. The adapters start
random (``model.lora.init = random``: the adapted model differs from the base from step 1) and train (overlong shaping
varies the rewards), so every version differs: the server's logprobs of the tokens it sampled must equal the actor's
(``train/logp_gap_mean``, bf16 server vs fp32 actor: ~1e-3) at every step. Measured with the requests not naming the
adapter: 0.22 from step 1; with the engine kept on the first version: 0.12 and 0.28 at steps 3 and 4; a base exported
merged (the adapter applied twice) fails too.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_trainer import BASE, dapo, metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LORA = ["model.lora.rank=8", "model.lora.init=random", "train.lr=1e-2", "rollout.sampling.max_new_tokens=12",
        "algo.overlong_penalty=true", "algo.overlong_cache=10"]  # fmt: skip


def test_adapter_only_sync_serves_the_actors_adapter_version_after_version(tmp_path):
    dapo("train", "--recipe", "demo_cpu_sglang", *BASE, *LORA, "train.steps=4", f"train.run_dir={tmp_path}",
         "train.name=lora")  # fmt: skip
    run = tmp_path / "lora"
    rows = {r["step"]: r for r in metrics(run)}
    assert sorted(rows) == [1, 2, 3, 4]
    for step, r in rows.items():
        assert r["train/logp_gap_mean"] < 0.01, (step, r["train/logp_gap_mean"])  # the server runs the actor's adapter
        # 2 layers x 7 modules (q, k, v, o, gate, up, down) x (A, B): kilobytes, not the model
        assert r["sync/tensors"] == 28 and r["sync/gb"] < 1e-3 and r["sync/version"] == step
    assert all(rows[s]["train/grad_norm"] > 0 for s in (2, 3, 4))  # the adapters move: each version differs

    log = (run / "sglang" / "sglang_server.log").read_text()
    loads = [line for line in log.splitlines() if "POST /load_lora_adapter" in line and "200 OK" in line]
    unloads = [line for line in log.splitlines() if "POST /unload_lora_adapter" in line and "200 OK" in line]
    assert len(loads) == 5 and len(unloads) == 4  # version 0 at the start, then one per step; the old one unloaded
    assert "update_weights_from" not in log  # the base never moved
    assert [p.name for p in (run / "lora_adapters").iterdir()] == ["dapo-v4.5"]  # only the served version is kept
    config = json.loads((run / "sglang_init" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    peft = json.loads((run / "hf_adapter" / "adapter_config.json").read_text())
    assert peft["r"] == 8 and peft["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


def test_the_streaming_schedule_interrupts_generation_to_switch_adapters(tmp_path):
    """rollout.schedule=stream with adapters: each sync aborts what is in flight, loads the new adapter and resumes the
    samples on it (a sample spans adapter versions; each token keeps the version it was sampled with)."""
    dapo("train", "--recipe", "demo_cpu_sglang", *BASE, *LORA, "train.steps=4", "rollout.schedule=stream",
         "rollout.stream_staleness=0.5", "algo.gen_batch_prompts=12", "algo.old_logprobs=rollout",
         "train.stream_updates=true", "train.mini_batch_prompts=2", f"train.run_dir={tmp_path}",
         "train.name=stream")  # fmt: skip
    rows = {r["step"]: r for r in metrics(tmp_path / "stream")}
    assert sorted(rows) == [1, 2, 3, 4]
    assert rows[1]["train/logp_gap_mean"] < 0.01  # the first batch, on version 0's adapter: the actor's
    assert all(r["sync/tensors"] == 28 and r["sync/gb"] < 1e-3 for r in rows.values())
    assert (
        rows[4]["rollout/interrupted_samples_total"] > 0
        and max(r["rollout/max_partial_span"] for r in rows.values()) >= 1
    )
    assert rows[4]["rollout/version_lag_max"] >= 1  # resumed samples: tokens of older adapter versions
