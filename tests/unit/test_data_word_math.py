"""The word_math task (recipe smollm2_math_cpu): deterministic by seed, eval split fixed by the arithmetic and disjoint
from train for every seed, worked solutions scored +1 by the DAPO rule; the recipe's engine fallback and hf_init
reference; format@k in the eval metrics."""

import importlib.util

import pytest

from megatron_dapo.config.run_config import load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.data.word_math import eval_rows, train_rows
from megatron_dapo.metrics import eval_metrics
from megatron_dapo.reward.math_dapo import compute_score


def _sig(row: dict) -> str:
    return row["extra_info"]["signature"]


def test_deterministic_disjoint_and_scored():
    evals = eval_rows(128, 2)
    assert [r["prompt"] for r in evals] == [r["prompt"] for r in eval_rows(128, 2)]  # no seed in it
    assert len({_sig(r) for r in evals}) == 128
    assert {r["extra_info"]["steps"] for r in evals} == {1, 2}
    for seed in (1, 2):
        train = train_rows(3000, seed, 2)
        assert [r["prompt"] for r in train[:50]] == [r["prompt"] for r in train_rows(50, seed, 2)]
        assert not {_sig(r) for r in train} & {_sig(r) for r in evals}
    assert train_rows(50, 1, 2) != train_rows(50, 2, 2)
    for r in evals + train[:200]:
        info, truth = r["extra_info"], r["reward_model"]["ground_truth"]
        assert int(truth) >= 1 and eval(info["signature"]) == int(truth)  # noqa: S307 (our own digits and signs)
        assert compute_score(info["solution"], truth)["score"] == 1.0
        assert compute_score(f"Answer: {int(truth) + 1}", truth)["score"] == -1.0
        assert r["prompt"][0]["content"].startswith("Solve the following math problem step by step.")
        assert "Answer: $Answer" in r["prompt"][0]["content"] and info["problem"] in r["prompt"][0]["content"]


def test_config_keys_are_checked_by_name():
    with pytest.raises(ConfigError, match="data.word_math_max_ops = 0"):
        load_config("smollm2_math_cpu", ["data.word_math_max_ops=0"])
    with pytest.raises(ConfigError, match="data.word_math_max_ops .* would be ignored"):
        load_config("demo_cpu", ["data.word_math_max_ops=3"])
    with pytest.raises(ConfigError, match="rollout.fallback_hf .* would be ignored"):
        load_config("demo_cpu", ["rollout.fallback_hf=true"])


def test_fallback_to_hf_engine_only_without_sglang(monkeypatch, capsys):
    from megatron_dapo.loop import trainer

    cfg = load_config("smollm2_math_cpu", ["model.hf_init=/some/dir"])
    trainer.prepare_model_and_engine(cfg)
    installed = importlib.util.find_spec("sglang") is not None
    assert (cfg.rollout.engine, cfg.model.hf_init) == ("sglang" if installed else "hf", "/some/dir")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    cfg = load_config("smollm2_math_cpu", ["model.hf_init=/some/dir"])
    trainer.prepare_model_and_engine(cfg)
    assert (cfg.rollout.engine, cfg.rollout.weight_sync) == ("hf", "copy")
    assert "sglang is not installed: the in-process HF engine" in capsys.readouterr().out
    cfg = load_config("smollm2_math_cpu", ["model.hf_init=/some/dir", "rollout.fallback_hf=false"])
    trainer.prepare_model_and_engine(cfg)
    assert cfg.rollout.engine == "sglang"  # asked for sglang, no fallback: the engine fails on start, naming it


def test_hf_init_reference():
    from megatron_dapo.models.gguf import resolve_hf_dir

    assert resolve_hf_dir(None) is None and resolve_hf_dir("/a/dir") == "/a/dir"
    with pytest.raises(FileNotFoundError, match="gguf:smollm2"):
        resolve_hf_dir("gguf:nothing")
    with pytest.raises(FileNotFoundError, match="no such file"):
        resolve_hf_dir("gguf:/no/such.gguf")


def test_format_rate_in_eval_metrics():
    recs = [{"data_source": "s", "problem_id": i, "pred": p, "acc": a, "valid": v}
            for i, (p, a, v) in enumerate([("3", True, True), ("4", False, True), ("[INVALID]", False, False),
                                           ("[INVALID]", False, False)])]  # fmt: skip
    out = eval_metrics(recs)
    assert out["eval/s/format@1"] == 0.5 and out["eval/s/avg@1"] == 0.25
    assert "eval/s/format@1" not in eval_metrics([{k: v for k, v in r.items() if k != "valid"} for r in recs])
