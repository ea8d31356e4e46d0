"""A non-finite gradient skips the update: weights untouched, the skip counted."""

import pytest
import torch


@pytest.fixture(scope="module")
def actor():
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.dist import teardown
    from megatron_dapo.config.run_config import load_config

    a = MegatronActor(
        load_config("demo_cpu", ["train.batch_prompts=2", "train.mini_batch_prompts=2", "algo.group_size=2"])
    )
    yield a
    teardown()


def _seqs(advantages):
    from megatron_dapo.types import Sequence

    g = torch.Generator().manual_seed(0)
    return [Sequence(torch.randint(0, 25, (14,), generator=g), 6, advantage=a) for a in advantages]


def test_nan_advantage_skips_the_update(actor):
    seqs = _seqs([float("nan"), 1.0, -1.0, 0.5])
    for s, lp in zip(seqs, actor.compute_logprobs(seqs)):
        s.old_logprobs = lp
    before = {k: v.detach().clone() for k, v in actor.named_parameters()}
    m = actor.train_step(seqs)
    assert m["train/skipped_updates"] == 1.0
    for k, v in actor.named_parameters():
        assert torch.equal(v, before[k]), k
    assert all(torch.isfinite(v).all() for _, v in actor.named_parameters())
    # the next finite step updates normally
    seqs = _seqs([1.0, -1.0, 1.0, -1.0])
    for s, lp in zip(seqs, actor.compute_logprobs(seqs)):
        s.old_logprobs = lp
    m = actor.train_step(seqs)
    assert m["train/skipped_updates"] == 1.0
    assert any(not torch.equal(v, before[k]) for k, v in actor.named_parameters())
