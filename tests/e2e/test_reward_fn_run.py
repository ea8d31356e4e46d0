"""A reward function from a module outside the package drives a short CPU training: the rewards the loop trains on
are its scores, and the numbers it returns besides the score are in metrics.jsonl as reward/<name>."""

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
