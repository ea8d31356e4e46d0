"""bench/schedule_model.py, the calibrated schedule model: from verl's 128-GPU colocated phase times it predicts
verl's 64:64 fully-async steps (streaming only, and with staleness 0.5 + partial rollout) within 25%; and properties
the model must keep on a small setting (an interrupting sync never waits longer, streaming never loses to batch by
batch, skipping the pi_old forward helps a trainer-bound run)."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "bench"))
import schedule_model as model  # noqa: E402

VERL = REPO / "bench" / "settings" / "verl_7b_h20_128.yaml"


def test_verls_fully_async_steps_are_predicted_within_25_percent_from_its_colocated_phases():
    s = model.Setting.load(VERL)
    k = model.calibrate(s, seed=0)
    cases = {c.name: c for c in s.cases}
    colocated = model.predict(s, cases["colocated sync"], k, steps=5)
    assert colocated["step_s"] == pytest.approx(356.30, rel=0.01)  # its inputs, replayed
    for name, measured in (("stream, staleness 0 (trigger 4, require_batches 4)", 231.34),
                           ("+ staleness 0.5, partial", 150.63)):  # fmt: skip
        case = cases[name]
        assert case.measured_step_s == measured and case.split == 64  # the setting says what verl measured, and where
        predicted = model.predict(s, case, k, steps=5)["step_s"]
        assert abs(predicted - measured) / measured < 0.25, (name, predicted, measured)


TINY = dict(name="tiny", source="test", gpus=16, batch_prompts=32, group_size=4, prompt_len=50, max_response=4096,
            lengths={"mean": 600, "sigma": 0.9, "at_cap": 0.03}, engine_gpus=1, slots=16, weight_gb=2.0,
            kv_kb_per_token=50.0, colocated={"gen_s": 60.0, "old_logprob_s": 10.0, "train_s": 30.0, "other_s": 0.0},
            train_s_by_gpus={4: 60.0, 16: 30.0}, old_logprob_s_by_gpus={4: 20.0, 16: 10.0}, sync_s=1.0)  # fmt: skip


def step(setting, **knobs) -> float:
    case = model.Case(name="x", split=8, chunk_prompts=8, sync_every=4, **knobs)
    return model.predict(setting, case, model.calibrate(setting), steps=4)["step_s"]


def test_an_interrupting_sync_never_waits_longer_and_streaming_never_loses_to_batch_by_batch():
    for seed_len in (400, 600, 900):
        s = model.Setting(**{**TINY, "lengths": {"mean": seed_len, "sigma": 0.9, "at_cap": 0.03}})
        wait = step(s, producer="stream", staleness=0.5, sync="wait")
        interrupt = step(s, producer="stream", staleness=0.5, sync="interrupt")
        batch = step(s, producer="batch", depth=1, sync="wait", order="prompt")
        assert interrupt <= wait * 1.02, (seed_len, interrupt, wait)
        assert interrupt <= batch * 1.02, (seed_len, interrupt, batch)


def test_skipping_the_pi_old_forward_shortens_a_trainer_bound_step_and_the_trainer_time_is_not_linear():
    s = model.Setting(**{**TINY, "lengths": {"mean": 100, "sigma": 0.5, "at_cap": 0.0}})  # cheap rollout
    recompute = step(s, producer="stream", staleness=0.5, sync="interrupt")
    rollout = step(s, producer="stream", staleness=0.5, sync="interrupt", old_logprobs="rollout")
    assert rollout < recompute * 0.9
    assert model.interpolate({4: 60.0, 16: 30.0}, 8) == pytest.approx(60.0 * 0.5**0.5)  # log-log between points
    assert model.interpolate({4: 60.0, 16: 30.0}, 2) == 60.0  # no extrapolation below the smallest measurement


def test_the_setting_files_name_their_sources_and_assumptions():
    for path in (REPO / "bench" / "settings").glob("*.yaml"):
        s = model.Setting.load(path)
        text = path.read_text()
        assert s.source and "ASSUMPTION" in text, path
        assert s.cases, path
    doc = (REPO / "docs" / "schedule-model.md").read_text()
    for word in ("calibrat", "ASSUMPTION", "interrupt", "staleness", "verl"):
        assert word in doc, word
