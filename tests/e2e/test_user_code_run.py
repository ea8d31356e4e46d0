"""User code in a short CPU training: a reward function from a module outside the package (the rewards the loop trains
on are its scores; its other numbers are in metrics.jsonl as reward/<name>), and a rollout function (the default
single turn written as one trains exactly as the engine's own generation does)."""

from __future__ import annotations

import textwrap

import pytest

from tests.e2e.test_trainer import BASE, dapo, metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PARITY = textwrap.dedent(
    """
    def parity(prompt, response, ground_truth, metadata):
        even = len(response) % 2 == 0
        return {"score": 1.0 if even else -1.0, "even": float(even), "chars": len(response)}
    """
)


def test_a_reward_function_outside_the_package_drives_training(tmp_path):
    user = tmp_path / "user_code" / "parity_reward.py"
    user.parent.mkdir()
    user.write_text(PARITY)
    dapo(
        "train",
        "--recipe",
        "demo_cpu",
        *BASE,
        "train.steps=2",
        "algo.overlong_penalty=false",  # the trained reward is the function's score alone
        f"reward.fn={user}:parity",
        "reward.workers=1",
        f"train.run_dir={tmp_path}",
        "train.name=fn",
    )
    rows = metrics(tmp_path / "fn")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/scored"] == 32 and r["reward/errors"] == 0  # 8 prompts x 4 responses, dynamic sampling off
        assert 0 < r["reward/chars"]
        # every generated group is trained on: the mean reward is the function's, through its "even" fraction
        assert r["train/reward_mean"] == pytest.approx(2 * r["reward/even"] - 1, abs=1e-6)


def test_a_rollout_function_runs_in_the_loop_and_single_turn_matches_the_engines_own(tmp_path):
    runs = {}
    for name, extra in (("engine", []), ("seam", ["rollout.generate=megatron_dapo.rollouts.single_turn:generate"])):
        dapo(
            "train",
            "--recipe",
            "demo_cpu",
            *BASE,
            "train.steps=2",
            *extra,
            f"train.run_dir={tmp_path}",
            f"train.name={name}",
        )
        runs[name] = metrics(tmp_path / name)
    for a, b in zip(runs["engine"], runs["seam"]):
        for key in ("train/reward_mean", "train/acc_mean", "train/response_len_mean", "reward/scored"):
            assert a[key] == b[key], key
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)


def test_the_tool_recipe_trains_through_the_tool_agent(tmp_path):
    dapo(
        "train",
        "--recipe",
        "tool_cpu",
        "train.supervised_warmup_steps=0",
        "algo.dynamic_sampling=false",  # an untrained model: every group wrong
        "train.steps=2",
        "train.batch_prompts=4",
        "train.mini_batch_prompts=2",
        "algo.gen_batch_prompts=6",  # 4 groups trained, the 2 in flight carried: resumed mid-turn next step
        "rollout.partial=true",
        "algo.group_size=2",
        "data.synthetic_train_size=100",
        "data.synthetic_eval_size=4",
        "eval.interval=2",
        "eval.n=1",
        "rollout.sampling.max_new_tokens=48",
        f"train.run_dir={tmp_path}",
        "train.name=tools",
    )
    rows = metrics(tmp_path / "tools")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/turns"] >= 1.0 and "rollout/used_tools" in r and r["rollout/carried_groups"] == 2
    assert "eval/synthetic/tool_mul/avg@1" in rows[-1] and "eval/synthetic/tool_mul/rollout/used_tools" in rows[-1]
