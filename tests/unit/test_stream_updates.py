"""Streaming training (``train.stream_updates``): each mini-batch update starts as soon as its groups are kept, and
the updates are those of the whole batch trained at once: the same weights, loss and gradient norm, bit for bit."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor.actor import MegatronActor
from megatron_dapo.algo.batch import Group, to_sequences
from megatron_dapo.config.run_config import load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.loop.updates import StreamedUpdates
from tests.helpers import fresh_actors

OVERRIDES = ["train.batch_prompts=4", "train.mini_batch_prompts=2", "algo.group_size=2", "train.warmup_steps=0",
             "algo.old_logprobs=rollout", "train.lr=1e-2"]  # fmt: skip


def groups(seed: int) -> list[Group]:
    """Four groups of two responses of varied length (so the mini-batches' token denominators differ)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(4):
        lengths = [3 + k, 7 + 2 * k]
        responses = [torch.randint(1, 60, (n,), generator=g).tolist() for n in lengths]
        out.append(
            Group(
                prompt_ids=torch.randint(1, 60, (4,), generator=g).tolist(),
                responses=responses,
                rollout_logprobs=[(-torch.rand(n, generator=g) * 4).tolist() for n in lengths],
                finish_reasons=["stop", "stop"],
                scores=[1.0, -1.0] if k % 2 else [-1.0, 1.0],
                correct=[bool(k % 2), not k % 2],
            )
        )
    return out


@pytest.fixture(scope="module")
def make_actor():
    yield from fresh_actors(lambda: load_config("demo_cpu", OVERRIDES))


def params(actor) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in actor.model[0].named_parameters()}


def test_streamed_updates_equal_the_whole_batchs(make_actor):
    metrics, weights = [], []
    for streamed in (False, True):
        actor = make_actor()
        step_metrics = []
        for step in range(2):  # two steps: the second starts from updated weights and an advanced LR schedule
            seqs, _ = to_sequences(groups(step), actor.cfg)
            if streamed:
                minis = [seqs[:4], seqs[4:]]  # 2 groups x 2 responses per mini-batch
                step_metrics.append(actor.finish_step(actor.train_streamed(lambda k, m=minis: m[k], 2)))
            else:
                step_metrics.append(actor.train_step(seqs))
        metrics.append(step_metrics)
        weights.append(params(actor))
    whole, streamed = weights
    assert any(not torch.equal(whole[n], p) for n, p in params(make_actor()).items())  # the steps moved the weights
    for name, p in whole.items():
        assert torch.equal(p, streamed[name]), name
    for a, b in zip(*metrics):
        for key in ("train/loss", "train/grad_norm", "train/clip_frac_high", "train/ppo_kl", "train/lr"):
            assert a[key] == b[key], key
        assert "time/update_s" in b and "time/update_s" not in a


def test_a_mini_batch_is_trained_before_the_next_groups_are_kept():
    """The order of events through ``StreamedUpdates``: update k runs before the schedule keeps mini-batch k+1."""
    events = []

    class Schedule:
        def mini_batches(self, step, size):
            for k in range(3):
                events.append(f"kept {k}")
                yield [f"seq {k}"] * size
            events.append("cut")
            self.last_batch = (["all"], ({"train/reward_mean": 0.5}, {"samples_generated": 6}))

    class Actor:
        cfg = load_config("demo_cpu", [*OVERRIDES, "train.batch_prompts=6"])

        def check_batch(self, mini):
            assert len(mini) == 2

        def update_mini_batch(self, mini, tally, from_forward):
            events.append(f"update {mini[0]} first={from_forward}")

        def finish_step(self, tally):
            events.append("finish")
            return {"train/loss": 0.0}

    actor = Actor()
    actor.train_streamed = MegatronActor.train_streamed.__get__(actor)
    updates = StreamedUpdates(actor.cfg, Schedule(), actor)
    trained, (metrics, stats) = updates.collect(1)
    assert events == ["kept 0", "update seq 0 first=True", "kept 1", "update seq 1 first=False", "kept 2",
                      "update seq 2 first=False", "cut"]  # fmt: skip
    assert trained == ["seq 0"] * 2 + ["seq 1"] * 2 + ["seq 2"] * 2 and stats["samples_generated"] == 6
    assert updates.train(trained) == {"train/loss": 0.0} and events[-1] == "finish"


@pytest.mark.parametrize(
    ("overrides", "needs"),
    [
        (["rollout.schedule=sync"], "rollout.schedule = 'stream'"),
        (["rollout.schedule=stream", "rollout.colocate=false"], "algo.old_logprobs = 'rollout'"),
    ],
)
def test_stream_updates_needs_the_stream_schedule_and_the_rollouts_old_logprobs(overrides, needs):
    with pytest.raises(ConfigError, match=rf"train.stream_updates = True: needs {needs}"):
        load_config("demo_cpu", ["train.stream_updates=true", *overrides])
