"""reward.fn: a user's reward function (a module or a file outside the package) scores the samples, in worker
processes with a time limit; failures score reward.failure_score and are counted, never kill a step, and a function
that fails on every sample stops the run naming itself."""

from __future__ import annotations

import logging
import textwrap
import time

import pytest

from megatron_dapo.config.run_config import RewardConfig, load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.reward.registry import RewardScorer
from megatron_dapo.reward.user_fn import RewardFunctionError

pytestmark = pytest.mark.timeout(300)

USER_MODULE = textwrap.dedent(
    """
    import asyncio, math, time

    def contains(prompt, response, ground_truth, metadata):
        return 1.0 if ground_truth in response else -1.0

    def with_extras(prompt, response, ground_truth, metadata):
        return {"score": 0.5 if ground_truth in response else -0.5, "length": len(response),
                "from_source": float(metadata["data_source"] == "mine"), "prompt_len": len(prompt)}

    def says_wrong(prompt, response, ground_truth, metadata):
        return {"score": 1.0, "acc": False}

    async def async_contains(prompt, response, ground_truth, metadata):
        await asyncio.sleep(0)
        return 1.0 if ground_truth in response else -1.0

    def batched(prompts, responses, ground_truths, metadatas):
        return [1.0 if t in r else -1.0 for r, t in zip(responses, ground_truths)]

    def batched_short(prompts, responses, ground_truths, metadatas):
        return [1.0]

    def fails_on_boom(prompt, response, ground_truth, metadata):
        if "boom" in response:
            raise ValueError("cannot parse " + response)
        return 1.0

    def always_fails(prompt, response, ground_truth, metadata):
        raise KeyError("answer")

    def sleeps_on_slow(prompt, response, ground_truth, metadata):
        if "slow" in response:
            time.sleep(60)
        return 1.0

    def not_finite(prompt, response, ground_truth, metadata):
        return math.nan

    def clashing(prompt, response, ground_truth, metadata):
        return {"score": 1.0, "errors": 3}

    NOT_A_FUNCTION = 3
    """
)


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "elsewhere" / "my_rewards.py"
    path.parent.mkdir()
    path.write_text(USER_MODULE)
    return path


def rows(*truths: str, source: str = "mine") -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": source, "reward_model": {"ground_truth": t}}
        for i, t in enumerate(truths)
    ]


def scorer(user_file, name: str, **kw) -> RewardScorer:
    return RewardScorer.from_config(RewardConfig(fn=f"{user_file}:{name}", **{"workers": 0, **kw}))


def test_a_function_from_a_file_scores_and_its_numbers_are_logged_as_reward_metrics(user_file):
    s = scorer(user_file, "with_extras")
    out = s.score_batch(["x = 42", "x = 7"], rows("42", "42"))
    assert [r["score"] for r in out] == [0.5, -0.5] and [r["acc"] for r in out] == [True, False]
    assert [r["status"] for r in out] == ["ok", "wrong"]
    m = s.metrics(reset=True)
    assert m["reward/length"] == 5.5 and m["reward/from_source"] == 1.0 and m["reward/prompt_len"] == 2.0
    assert m["reward/scored"] == 2 and m["reward/correct"] == 1
    assert "reward/length" not in s.metrics()  # reset: a step's numbers are that step's
    assert scorer(user_file, "says_wrong").score("x", rows("1")[0])["acc"] is False  # an "acc" of its own wins


def test_a_module_on_the_path_runs_in_worker_processes_async_too(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))  # spawned workers get the parent's sys.path
    for name in ("contains", "async_contains"):
        with RewardScorer.from_config(RewardConfig(fn=f"my_rewards:{name}", workers=2)) as s:
            out = s.score_batch(["a 5", "b", "5!"], rows("5", "5", "5"))
            assert [r["score"] for r in out] == [1.0, -1.0, 1.0], name
            pids = s.user_fn.pool.worker_pids()
            assert len(pids) == 2 and all(pid != __import__("os").getpid() for pid in pids)


def test_a_batched_function_gets_lists_and_a_wrong_length_is_a_failure(user_file):
    out = scorer(user_file, "batched", batched=True).score_batch(["5", "6"], rows("5", "5"))
    assert [r["score"] for r in out] == [1.0, -1.0]
    s = scorer(user_file, "batched_short", batched=True, failure_score=-3.0)
    out = s.score_batch(["5", "6"], rows("5", "5"))
    assert [r["score"] for r in out] == [-3.0, -3.0] and "expected a list of 2" in out[0]["pred"]
    assert s.metrics()["reward/errors"] == 2


def test_a_raising_call_scores_the_failure_score_is_counted_and_the_first_is_shown(user_file, caplog):
    s = scorer(user_file, "fails_on_boom", failure_score=-2.0)
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.reward.user_fn"):
        out = s.score_batch(["fine", "boom 1", "ok", "boom 2"], rows("1", "1", "1", "1"))
    assert [r["score"] for r in out] == [1.0, -2.0, 1.0, -2.0]
    assert [r["status"] for r in out] == ["ok", "error", "ok", "error"]
    assert s.metrics()["reward/errors"] == 2
    shown = [r.getMessage() for r in caplog.records]
    assert len(shown) == 1, shown  # the first failure only; the later ones are counted
    assert "fails_on_boom" in shown[0] and "ValueError: cannot parse boom 1" in shown[0] and "'boom 1'" in shown[0]


def test_a_call_past_its_time_limit_is_a_timeout_and_the_rest_of_the_batch_scores(user_file):
    with scorer(user_file, "sleeps_on_slow", workers=2, timeout_s=1.0) as s:
        start = time.monotonic()
        out = s.score_batch(["a", "slow", "b"], rows("1", "1", "1"))
        elapsed = time.monotonic() - start
        assert [r["status"] for r in out] == ["ok", "timeout", "ok"] and out[1]["score"] == -1.0
        assert "reward.timeout_s" in out[1]["pred"]
        assert s.metrics()["reward/timeouts"] == 1
        assert elapsed < 45, elapsed  # the time limit, not the function's minute


def test_a_function_that_fails_on_every_sample_stops_the_run_naming_itself(user_file):
    s = scorer(user_file, "always_fails", max_consecutive_failures=5)
    s.score_batch(["a", "b", "c"], rows("1", "1", "1"))  # three failures: the step goes on
    with pytest.raises(RewardFunctionError) as e:
        s.score_batch(["d", "e", "f"], rows("1", "1", "1"))
    msg = str(e.value)
    assert "always_fails" in msg and "failed on the last 5 samples" in msg and "KeyError: 'answer'" in msg
    assert "response 'a'" in msg  # the first failing sample
    ok = scorer(user_file, "fails_on_boom", max_consecutive_failures=2)
    for _ in range(3):  # failures with successes between them never add up
        ok.score_batch(["boom", "fine"], rows("1", "1"))


@pytest.mark.parametrize(
    ("name", "needle"),
    [("not_finite", "must be a finite number"), ("clashing", "names the scorer logs itself")],
)
def test_a_return_value_it_cannot_log_is_a_failure_that_says_why(user_file, name, needle):
    out = scorer(user_file, name).score("x", rows("1")[0])
    assert out["status"] == "error" and needle in out["pred"]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("{file}:missing", "has no attribute 'missing'"),
        ("{file}:NOT_A_FUNCTION", "int object is not callable"),
        ("no_such_module_xyz:score", "importing 'no_such_module_xyz' failed: ModuleNotFoundError"),
        ("{dir}/absent.py:score", "no such file"),
        ("just_a_name", "expected 'package.module:function'"),
    ],
)
def test_a_bad_reward_fn_is_a_config_error_naming_the_key(user_file, spec, needle):
    spec = spec.format(file=user_file, dir=user_file.parent)
    with pytest.raises(ConfigError) as e:
        RewardScorer.from_config(RewardConfig(fn=spec))
    assert f"reward.fn = {spec!r}" in str(e.value) and needle in str(e.value)


def test_reward_settings_are_validated_and_unused_ones_refused():
    with pytest.raises(ConfigError, match=r"reward.workers = -1: must be >= 0"):
        load_config("demo_cpu", ["reward.fn=m:f", "reward.workers=-1"])
    with pytest.raises(ConfigError, match=r"reward.timeout_s = 0.0: must be > 0"):
        load_config("demo_cpu", ["reward.fn=m:f", "reward.timeout_s=0.0"])
    with pytest.raises(ConfigError, match=r"reward.timeout_s = 5.0 would be ignored: reward.fn = null"):
        load_config("demo_cpu", ["reward.timeout_s=5.0"])
    assert load_config("demo_cpu", ["reward.fn=m:f"]).reward.fn == "m:f"  # loaded when the run starts
