"""The RL learning-rate schedule, sized to the run that actually happens.

    scheduler = make_scheduler(optimizer, cfg.train)
    scheduler.set_spent(samples=samples_generated, seconds=rl_seconds)   # the trainer, before each train step
    ... actor.train_step(...)                                             # ends with scheduler.step(increment=1)

Linear warmup over ``train.warmup_steps`` steps from 0 to ``train.lr``, then (with ``train.min_lr`` set) a cosine
down to ``train.min_lr`` that ends when the run ends, whichever of its bounds ends it: ``train.steps``,
``train.sample_budget`` (samples generated, as the trainer counts them for that budget, dynamic-sampling rounds
included) or ``train.time_budget_s`` (RL seconds). The decay's position is the largest fraction spent of the bounds that
are set, each counted from where the warmup ended; so the LR reaches ``train.min_lr`` exactly when the first bound is
reached. Steps and samples are deterministic (a seeded run, and its resume, gets the same LR bit for bit); while the
time budget leads, the LR depends on the machine's speed and is not reproducible.

A checkpoint keeps the schedule (megatron-core's scheduler state plus the samples and seconds spent and those at the end
of the warmup): a resumed run continues it exactly, with the horizon it started with, as megatron-core does for
``train.steps`` (``use_checkpoint_opt_param_scheduler``); a changed bound is noted on stderr.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

# state_dict keys of ours, next to megatron-core's
_OURS = ("sample_budget", "time_budget_s", "spent_samples", "spent_seconds", "warmup_end_samples", "warmup_end_seconds")


class BudgetScheduler(OptimizerParamScheduler):
    """megatron-core's scheduler (warmup, weight decay, ``wd_mult``) with the decay driven by the run's budgets."""

    def __init__(self, optimizer: Any, *, sample_budget: int = 0, time_budget_s: float = 0.0, **kwargs: Any):
        # set before megatron-core's __init__, which computes the first learning rate
        self.sample_budget, self.time_budget_s = int(sample_budget), float(time_budget_s)
        self.spent_samples, self.spent_seconds = 0, 0.0
        self.warmup_end_samples, self.warmup_end_seconds = 0, 0.0
        super().__init__(optimizer, **kwargs)

    def set_spent(self, samples: int, seconds: float) -> None:
        """What the run has spent so far (samples generated, RL seconds; the same on every rank): the next
        ``step()`` sets the learning rate of the next update from it."""
        self.spent_samples, self.spent_seconds = int(samples), float(seconds)

    def step(self, increment: int) -> None:
        if increment and self.num_steps + increment == self.lr_warmup_steps:  # the warmup ends here: decay starts
            self.warmup_end_samples, self.warmup_end_seconds = self.spent_samples, self.spent_seconds
        super().step(increment)

    def decay_fraction(self) -> tuple[float, str]:
        """(position in the decay in [0, 1], the bound that sets it: steps | samples | seconds)."""
        n, w, total = self.num_steps, self.lr_warmup_steps, self.lr_decay_steps
        out = (1.0 if n > total else float(n - w) / float(total - w), "steps")  # megatron-core's own arithmetic
        for name, spent, start, budget in (
            ("samples", self.spent_samples, self.warmup_end_samples, self.sample_budget),
            ("seconds", self.spent_seconds, self.warmup_end_seconds, self.time_budget_s),
        ):
            if budget > 0:
                x = 1.0 if spent >= budget or start >= budget else (spent - start) / (budget - start)
                out = max(out, (x, name))
        return min(max(out[0], 0.0), 1.0), out[1]

    def get_lr(self, param_group: dict) -> float:
        warming = self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps
        if warming or self.lr_decay_style not in ("cosine", "linear"):
            return super().get_lr(param_group)
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        x = self.decay_fraction()[0]
        coeff = 0.5 * (math.cos(math.pi * x) + 1.0) if self.lr_decay_style == "cosine" else 1.0 - x
        return min_lr + coeff * (max_lr - min_lr)

    def state_dict(self) -> dict:
        return {**super().state_dict(), **{k: getattr(self, k) for k in _OURS}}

    def load_state_dict(self, state_dict: dict) -> None:
        asked = (self.lr_decay_steps, self.sample_budget, self.time_budget_s)
        for k in _OURS:  # before megatron-core's load, which recomputes the learning rate (an older checkpoint: 0)
            setattr(self, k, type(getattr(self, k))(state_dict.get(k, 0)))
        super().load_state_dict(state_dict)  # its step(num_steps) must not move where the warmup ended
        self.warmup_end_samples = int(state_dict.get("warmup_end_samples", 0))
        self.warmup_end_seconds = float(state_dict.get("warmup_end_seconds", 0.0))
        kept = (self.lr_decay_steps, self.sample_budget, self.time_budget_s)
        if kept != asked and (not dist.is_initialized() or dist.get_rank() == 0):
            print(
                f"lr schedule: the checkpoint's horizon (train.steps {kept[0]}, train.sample_budget {kept[1]}, "
                f"train.time_budget_s {kept[2]:g}) continues; this run's bounds ({asked[0]}, {asked[1]}, "
                f"{asked[2]:g}) still decide when it stops",
                file=sys.stderr,
                flush=True,
            )


def make_scheduler(optimizer: Any, t: Any) -> BudgetScheduler:
    """The schedule of ``TrainConfig`` ``t``: one scheduler step per train step (as verl's DAPO recipe counts warmup).
    Weight decay is excluded from norms and biases (``wd_mult`` = 0) only through the scheduler, so it is always used."""
    total = max(t.steps, t.warmup_steps + 1)
    return BudgetScheduler(
        optimizer,
        sample_budget=t.sample_budget,
        time_budget_s=t.time_budget_s,
        init_lr=0.0 if t.warmup_steps else t.lr,
        max_lr=t.lr,
        min_lr=t.min_lr if t.min_lr is not None else t.lr,
        lr_warmup_steps=t.warmup_steps,
        lr_decay_steps=total,
        lr_decay_style="constant" if t.min_lr is None else "cosine",
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=total,
        wd_incr_style="constant",
    )
