"""Tokens a rollout inserts (a tool's output, loss mask 0) are context only: they change neither the loss nor the
gradient, and stay out of the overlong penalty's length and the logprob gap. Planting mask 1 on them must show."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.algo.batch import Group, logprob_gap_stats, policy_entropy, to_sequences
from megatron_dapo.config.run_config import load_config
from tests.helpers import fresh_actors

PROMPT = [5, 6, 7]
# model tokens, then a tool's output (mask 0), then model tokens again
RESPONSE = [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
MASK = [1, 1, 1, 0, 0, 0, 0, 1, 1, 1]


def group(mask=MASK, responses=2):
    return Group(
        prompt_ids=PROMPT,
        responses=[list(RESPONSE)] * responses,
        rollout_logprobs=[[-0.5 if m else 0.0 for m in mask or [1] * len(RESPONSE)]] * responses,
        finish_reasons=["stop"] * responses,
        scores=[1.0, -1.0][:responses],
        correct=[True, False][:responses],
        loss_masks=[list(mask)] * responses if mask else [],
    )


def test_sequences_carry_the_mask_and_the_metrics_leave_inserted_tokens_out():
    cfg = load_config("demo_cpu")
    seqs, metrics = to_sequences([group()], cfg)
    assert seqs[0].loss_mask.tolist() == [float(m) for m in MASK]
    assert seqs[0].generated.tolist() == [bool(m) for m in MASK]
    assert metrics["train/inserted_token_frac"] == pytest.approx(4 / 10)
    actor = [torch.tensor([-0.5 if m else -9.0 for m in MASK]) for _ in range(2)]  # far off on inserted tokens only
    gap = logprob_gap_stats([group()], actor)
    assert gap["train/logp_gap_max"] == 0.0 and gap["train/logp_gap_tokens"] == 12  # 6 model tokens x 2
    for s in seqs:
        s.entropy = torch.tensor([1.0 if m else 50.0 for m in MASK])
    assert policy_entropy(seqs) == 1.0


def test_the_overlong_penalty_counts_the_models_own_tokens():
    # max_new_tokens 12, cache 4: the penalty starts past 8 tokens; the response is 10 long, the model wrote 6
    cfg = load_config("demo_cpu", ["algo.overlong_penalty=true", "algo.overlong_cache=4"])
    cfg.rollout.sampling.max_new_tokens = 12
    _, metrics = to_sequences([group()], cfg)
    assert metrics["train/reward_mean"] == 0.0  # +1 and -1, unpenalized
    _, metrics = to_sequences([group(mask=None)], cfg)  # the same response counted whole: penalized
    assert metrics["train/reward_mean"] < 0.0


@pytest.fixture(scope="module")
def make_actor():
    overrides = ["train.batch_prompts=1", "train.mini_batch_prompts=1", "algo.group_size=2", "train.warmup_steps=0"]
    yield from fresh_actors(lambda: load_config("demo_cpu", overrides))


def trained(make_actor, mask, inserted_old_logprob: float) -> dict[str, torch.Tensor]:
    """Parameters after one step on the group, π_old on the inserted tokens set to ``inserted_old_logprob``."""
    actor = make_actor()
    seqs, _ = to_sequences([group(mask=mask)], actor.cfg)
    for s, lp in zip(seqs, actor.compute_logprobs(seqs)):
        lp = lp.clone()
        lp[torch.tensor(MASK) == 0] = inserted_old_logprob  # what the trainer believes of tokens it never sampled
        s.old_logprobs = lp
    actor.train_step(seqs)
    return {k: v.detach().clone() for k, v in actor.named_parameters()}


def test_inserted_tokens_change_neither_the_loss_nor_the_gradient(make_actor):
    before = {k: v.detach().clone() for k, v in make_actor().named_parameters()}
    a = trained(make_actor, MASK, -0.1)
    b = trained(make_actor, MASK, -7.0)
    assert any(not torch.equal(a[k], before[k]) for k in a)  # the step updates
    assert all(torch.equal(a[k], b[k]) for k in a)  # the update never saw them
    # planted: the same tokens in the loss (mask 1) and the update depends on them
    c = trained(make_actor, [1] * len(MASK), -0.1)
    d = trained(make_actor, [1] * len(MASK), -7.0)
    assert any(not torch.equal(c[k], d[k]) for k in c)


def warm_started(make_actor, tail: list[int], masked: bool) -> dict[str, torch.Tensor]:
    """Parameters after one supervised step on a response whose last tokens are ``tail`` (a tool's output)."""
    from megatron_dapo.types import Sequence

    actor = make_actor()
    seq = Sequence(torch.tensor(PROMPT + [8, 9, 10] + tail), prompt_len=len(PROMPT))
    seq.loss_mask = torch.tensor([1.0] * 3 + [0.0 if masked else 1.0] * len(tail))
    actor.supervised_step([seq], lr=1e-2)
    return {k: v.detach().clone() for k, v in actor.named_parameters()}


def test_the_warm_start_does_not_train_a_tools_output(make_actor):
    a = warm_started(make_actor, [11, 12, 13], masked=True)
    b = warm_started(make_actor, [20, 21, 22], masked=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = warm_started(make_actor, [11, 12, 13], masked=False)  # planted: trained, and then it matters
    d = warm_started(make_actor, [20, 21, 22], masked=False)
    assert any(not torch.equal(c[k], d[k]) for k in c)
