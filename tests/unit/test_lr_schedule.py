"""The RL learning-rate schedule decays over the run that happens (actor/lr_schedule.py): over train.sample_budget or
train.time_budget_s when they end the run before train.steps, exactly as megatron-core over train.steps otherwise, and
a checkpoint's scheduler state continues it exactly."""

import math

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_dapo.actor.lr_schedule import make_scheduler
from megatron_dapo.config.run_config import TrainConfig, load_config
from megatron_dapo.config.typed_yaml import ConfigError

LR, MIN_LR = 1e-3, 1e-4


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=LR)


def _cosine(x: float) -> float:
    return MIN_LR + 0.5 * (math.cos(math.pi * x) + 1.0) * (LR - MIN_LR)


def _run(sched, steps: int, samples_per_step: int = 0, seconds_per_step: float = 0.0, start: int = 0) -> list[float]:
    """The trainer's order: spent after the step's rollout, then the step (which sets the next update's LR)."""
    lrs = []
    for n in range(start + 1, start + steps + 1):
        sched.set_spent(n * samples_per_step, n * seconds_per_step)
        sched.step(increment=1)
        lrs.append(sched.optimizer.param_groups[0]["lr"])
    return lrs


def test_sample_budget_sets_the_horizon_not_train_steps():
    """train.steps huge, the run bounded by 10 steps' samples: the LR is halfway at step 5 and at min_lr at step 10
    (decaying over train.steps it would still be at its peak)."""
    t = TrainConfig(steps=100_000, sample_budget=10 * 512, lr=LR, min_lr=MIN_LR, warmup_steps=0)
    sched = make_scheduler(_optimizer(), t)
    lrs = _run(sched, 10, samples_per_step=512)
    assert lrs[4] == pytest.approx(_cosine(0.5), rel=1e-12)
    assert lrs[9] == pytest.approx(MIN_LR, rel=1e-12)
    assert sched.decay_fraction() == (1.0, "samples")


def test_warmup_in_steps_then_decay_over_the_samples_left():
    """Dynamic sampling: 3 rounds per step early. The warmup counts steps; the decay starts from the samples spent when
    it ended and ends on the budget."""
    t = TrainConfig(steps=100_000, sample_budget=4000, lr=LR, min_lr=MIN_LR, warmup_steps=4)
    sched = make_scheduler(_optimizer(), t)
    lrs = _run(sched, 4, samples_per_step=300)
    assert lrs == pytest.approx([LR / 4, LR / 2, 3 * LR / 4, LR])
    assert sched.warmup_end_samples == 1200
    sched.set_spent(1200 + 1400, 0.0)
    sched.step(increment=1)
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(_cosine(0.5), rel=1e-12)


def test_time_budget_sets_the_horizon_when_it_leads():
    t = TrainConfig(steps=100_000, time_budget_s=60.0, sample_budget=10**9, lr=LR, min_lr=MIN_LR, warmup_steps=0)
    sched = make_scheduler(_optimizer(), t)
    lrs = _run(sched, 4, samples_per_step=10, seconds_per_step=15.0)
    assert lrs[1] == pytest.approx(_cosine(0.5), rel=1e-12) and lrs[3] == pytest.approx(MIN_LR, rel=1e-12)
    assert sched.decay_fraction()[1] == "seconds"


def test_steps_only_is_megatron_cores_schedule_bit_for_bit():
    """No budget (or one never reached): the same floats as megatron-core's scheduler over train.steps."""
    for t in (TrainConfig(steps=30, lr=LR, min_lr=MIN_LR, warmup_steps=5),
              TrainConfig(steps=30, lr=LR, min_lr=MIN_LR, warmup_steps=5, sample_budget=10**9, time_budget_s=1e9),
              TrainConfig(steps=30, lr=LR, min_lr=None, warmup_steps=5)):  # fmt: skip
        ours = _run(make_scheduler(_optimizer(), t), 35, samples_per_step=64, seconds_per_step=1.0)
        ref = OptimizerParamScheduler(
            _optimizer(), init_lr=0.0, max_lr=LR, min_lr=t.min_lr or LR, lr_warmup_steps=5, lr_decay_steps=30,
            lr_decay_style="constant" if t.min_lr is None else "cosine", start_wd=0.1, end_wd=0.1,
            wd_incr_steps=30, wd_incr_style="constant",
        )  # fmt: skip
        theirs = []
        for _ in range(35):
            ref.step(increment=1)
            theirs.append(ref.optimizer.param_groups[0]["lr"])
        assert ours == theirs


def test_resume_continues_the_schedule_exactly(capsys):
    """state_dict after 6 steps (inside the decay) into a fresh scheduler: the same LRs as the uninterrupted run; a
    resume that asks for another budget keeps the checkpoint's horizon and says so."""
    t = TrainConfig(steps=100_000, sample_budget=5000, lr=LR, min_lr=MIN_LR, warmup_steps=3)
    straight = _run(make_scheduler(_optimizer(), t), 12, samples_per_step=400)
    first = make_scheduler(_optimizer(), t)
    head = _run(first, 6, samples_per_step=400)
    again = make_scheduler(_optimizer(), TrainConfig(**{**t.__dict__, "sample_budget": 9000}))
    again.load_state_dict(first.state_dict())
    assert again.optimizer.param_groups[0]["lr"] == head[-1]
    assert head + _run(again, 6, samples_per_step=400, start=6) == straight
    assert "the checkpoint's horizon" in capsys.readouterr().err


def test_negative_budgets_are_refused_by_name():
    with pytest.raises(ConfigError, match="train.sample_budget"):
        load_config("demo_cpu", ["train.sample_budget=-1"])
    with pytest.raises(ConfigError, match="train.time_budget_s"):
        load_config("demo_cpu", ["train.time_budget_s=-5"])
