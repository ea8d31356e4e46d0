"""algo/batch.py: scored groups → shaped rewards → advantages → training sequences, and the logprob gap statistic."""

import pytest
import torch

from megatron_dapo.algo.batch import Group, group_from_samples, logprob_gap_stats, shaped_rewards, to_sequences
from megatron_dapo.config.run_config import DapoConfig
from megatron_dapo.types import Sample


def group(prompt, responses, correct, finish=None, logprobs=None):
    return Group(
        prompt_ids=list(prompt),
        responses=[list(r) for r in responses],
        rollout_logprobs=logprobs or [[-0.5] * len(r) for r in responses],
        finish_reasons=finish or ["stop"] * len(responses),
        scores=[1.0 if c else -1.0 for c in correct],
        correct=list(correct),
    )


def cfg(**algo) -> DapoConfig:
    c = DapoConfig()
    c.rollout.sampling.max_new_tokens = 10
    c.algo.overlong_cache = 4
    for k, v in algo.items():
        setattr(c.algo, k, v)
    return c


def test_group_from_samples_keeps_order_and_fields():
    samples = [Sample([1, 2], [3 + j, 9], [-0.1 * j, -0.2], "stop", text=f"t{j}", sample_index=j) for j in range(3)]
    results = [{"score": 1.0, "acc": True}, {"score": -1.0, "acc": False}, {"score": 1.0, "acc": True}]
    g = group_from_samples([1, 2], samples, results, "src")
    assert g.responses == [[3, 9], [4, 9], [5, 9]] and g.rollout_logprobs[2] == [-0.2, -0.2]
    assert g.correct == [True, False, True] and g.scores == [1.0, -1.0, 1.0] and g.texts == ["t0", "t1", "t2"]


def test_shaped_rewards_add_the_soft_overlong_penalty():
    # L_max 10, L_cache 4: lengths 6 (no penalty), 8 ((6 - 8) / 4 = -0.5), 10 (-1.0)
    g = group([1], [[5] * 6, [5] * 8, [5] * 10], [True, True, False])
    assert shaped_rewards([g], cfg()).tolist() == [[1.0, 0.5, -2.0]]
    assert shaped_rewards([g], cfg(overlong_penalty=False)).tolist() == [[1.0, 1.0, -1.0]]


def test_to_sequences_layout_advantages_and_masks():
    g1 = group([1, 2, 3], [[4, 5], [6], [7, 8, 9]], [True, False, False], finish=["stop", "stop", "length"])
    g2 = group([1], [[4], [4], [4]], [True, True, True])  # all correct: zero advantage
    seqs, m = to_sequences([g1, g2], cfg(overlong_penalty=False, overlong_filter=True))
    assert [s.tokens.tolist() for s in seqs] == [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3, 7, 8, 9]] + [[1, 4]] * 3
    assert [s.prompt_len for s in seqs] == [3, 3, 3, 1, 1, 1]
    # rewards (1, -1, -1): mean -1/3, unbiased std 2/sqrt(3)
    std = (4 / 3) ** 0.5
    expected = [(1 + 1 / 3) / std, (-1 + 1 / 3) / std, (-1 + 1 / 3) / std, 0.0, 0.0, 0.0]
    assert [s.advantage for s in seqs] == pytest.approx(expected, rel=1e-5)
    assert [s.loss_mask.tolist() for s in seqs[:3]] == [[1, 1], [1], [0, 0, 0]]  # the truncated one is filtered
    assert m["train/acc_mean"] == pytest.approx(4 / 6) and m["train/truncated_frac"] == pytest.approx(1 / 6)
    assert m["train/response_len_max"] == 3 and m["train/response_len_mean"] == pytest.approx(9 / 6)


def test_logprob_gap_over_aligned_tokens():
    g = group([1], [[4, 5], [6]], [True, False], logprobs=[[-1.0, -2.0], [-3.0]])
    stats = logprob_gap_stats([g], [torch.tensor([-1.5, -2.0]), torch.tensor([-1.0])])
    assert stats["train/logp_gap_mean"] == pytest.approx((0.5 + 0 + 2.0) / 3)
    assert stats["train/logp_gap_max"] == pytest.approx(2.0) and stats["train/logp_gap_tokens"] == 3


def test_misaligned_logprobs_are_an_error_not_a_zero_gap():
    # the planted fault: rollout logprobs of -9 per token against an actor tensor one token short
    g = group([1], [[4, 5, 6]], [True], logprobs=[[-9.0, -9.0, -9.0]])
    with pytest.raises(ValueError, match="group 0 sample 0 has 3 rollout logprobs but the actor computed 2"):
        logprob_gap_stats([g], [torch.tensor([-0.1, -0.1])])
    with pytest.raises(ValueError, match="1 rollout sequences but 2 actor sequences"):
        logprob_gap_stats([g], [torch.zeros(3), torch.zeros(3)])
