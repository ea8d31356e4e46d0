"""Per-token TIS of partial rollout (algo/loss.py ``tis_mask``): only the tokens sampled from older weights than
π_old are weighted; the others count as in a plain on-policy loss."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.algo.loss import combine_loss_metrics, policy_loss


def case(seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(3, 7, generator=g, dtype=torch.float64) * 2).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(3, 7, generator=g, dtype=torch.float64)
    rollout = old + 0.8 * torch.randn(3, 7, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.2, -0.6, 0.9], dtype=torch.float64)
    mask = torch.rand(3, 7, generator=g) > 0.15
    stale = torch.zeros(3, 7, dtype=torch.bool)
    stale[0, :4] = True  # a resumed sample: its first 4 tokens from the previous version
    stale[2, :] = True  # a sample wholly from older weights
    return lp, old, rollout, adv, mask, stale


def per_token(lp, old, adv, mask):
    """The plain (un-aggregated) clipped surrogate per token: token-mean with denominator 1 over one token."""
    out = torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[i, t]:
                one = torch.zeros_like(mask)
                one[i, t] = True
                out[i, t] = policy_loss(lp, old, adv, one, clip_c=3.0, denominator=1)[0]
    return out


def test_only_the_masked_tokens_are_weighted():
    lp, old, rollout, adv, mask, stale = case()
    loss, m = policy_loss(lp, old, adv, mask, clip_c=3.0, rollout_logprobs=rollout, tis_cap=2.0, tis_mask=stale)
    w = torch.where(stale, (old - rollout).exp().clamp(max=2.0), torch.ones_like(old))
    expected = (per_token(lp, old, adv, mask) * w)[mask].sum() / mask.sum()
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-12)
    weighted = stale & mask
    assert int(m["tis_tokens"]) == int(weighted.sum())
    assert float(m["tis_mean"]) == pytest.approx(float(w[weighted].mean()))
    assert float(m["tis_token_frac"]) == pytest.approx(float(weighted.sum() / mask.sum()))
    # no token masked: the plain loss exactly; every token masked: the full TIS loss
    none, _ = policy_loss(lp, old, adv, mask, clip_c=3.0, rollout_logprobs=rollout, tis_cap=2.0,
                          tis_mask=torch.zeros_like(stale))  # fmt: skip
    assert torch.equal(none, policy_loss(lp, old, adv, mask, clip_c=3.0)[0])
    full, _ = policy_loss(lp, old, adv, mask, clip_c=3.0, rollout_logprobs=rollout, tis_cap=2.0,
                          tis_mask=torch.ones_like(stale))  # fmt: skip
    assert torch.equal(full, policy_loss(lp, old, adv, mask, clip_c=3.0, rollout_logprobs=rollout, tis_cap=2.0)[0])


def test_masked_metrics_combine_over_micro_batches():
    lp, old, rollout, adv, mask, stale = case(6)
    kw = dict(clip_c=3.0, tis_cap=2.0, denominator=mask.sum())
    whole = policy_loss(lp, old, adv, mask, rollout_logprobs=rollout, tis_mask=stale, **kw)[1]
    parts = [policy_loss(lp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1],
                         rollout_logprobs=rollout[i : i + 1], tis_mask=stale[i : i + 1], **kw)[1] for i in range(3)]  # fmt: skip
    combined = combine_loss_metrics(parts)
    for key in ("tis_mean", "tis_token_frac", "tis_capped_frac", "tis_tokens"):
        assert float(combined[key]) == pytest.approx(float(whole[key]), rel=1e-12), key
    with pytest.raises(ValueError, match="tis_mask has shape"):
        policy_loss(lp, old, adv, mask, rollout_logprobs=rollout, tis_cap=2.0, tis_mask=stale[:, :3])
