"""policy_loss against a plain-Python per-element reference; gradients; micro-batch exactness; metrics."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.algo import AGG_MODES, combine_loss_metrics, loss_denominator, policy_loss

pytestmark = pytest.mark.timeout(120)

EPS_LOW, EPS_HIGH, CLIP_C = 0.2, 0.28, 10.0


def make_batch(seed: int, batch: int = 11, seq: int = 13, per_token_adv: bool = False, dtype=torch.float64):
    """Random inputs that hit every regime: ratios inside/below/above the clip range and beyond clip_c."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, seq, generator=g, dtype=dtype) * 5
    log_ratio = torch.randn(batch, seq, generator=g, dtype=dtype) * 0.5
    far = torch.rand(batch, seq, generator=g) < 0.2
    log_ratio[far] = 3.0 * torch.sign(torch.randn(int(far.sum()), generator=g, dtype=dtype))  # e^3 > clip_c
    logprobs = old + log_ratio
    adv_shape = (batch, seq) if per_token_adv else (batch,)
    adv = torch.randn(*adv_shape, generator=g, dtype=dtype)
    lengths = torch.randint(1, seq + 1, (batch,), generator=g)
    lengths[3] = 0  # one row with no valid token
    mask = torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)
    mask &= torch.rand(batch, seq, generator=g) > 0.1  # holes inside responses too
    return logprobs, old, adv, mask


def reference_token_losses(lp, old, adv, mask, eps_low, eps_high, clip_c):
    """Per-token losses (None where masked) with Python floats only."""
    out = []
    for i in range(len(lp)):
        row = []
        for t in range(len(lp[i])):
            if not mask[i][t]:
                row.append(None)
                continue
            a = adv[i][t] if isinstance(adv[i], list) else adv[i]
            r = math.exp(lp[i][t] - old[i][t])
            clipped = min(max(r, 1 - eps_low), 1 + eps_high)
            pg = max(-a * r, -a * clipped)
            if clip_c is not None and a < 0:
                pg = min(pg, -a * clip_c)
            row.append(pg)
        out.append(row)
    return out


def reference_loss(lp, old, adv, mask, agg, eps_low=EPS_LOW, eps_high=EPS_HIGH, clip_c=CLIP_C):
    losses = reference_token_losses(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), eps_low, eps_high, clip_c)
    if agg == "token-mean":
        values = [x for row in losses for x in row if x is not None]
        return sum(values) / len(values) if values else 0.0
    seq_values = []
    for row in losses:
        valid = [x for x in row if x is not None]
        if valid:
            seq_values.append(sum(valid) / len(valid) if agg == "seq-mean-token-mean" else sum(valid))
    return sum(seq_values) / len(seq_values) if seq_values else 0.0


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("clip_c", [CLIP_C, None])
def test_loss_matches_python_reference(agg, per_token_adv, clip_c):
    for seed in range(3):
        lp, old, adv, mask = make_batch(seed, per_token_adv=per_token_adv)
        loss, _ = policy_loss(lp, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, clip_c=clip_c, agg=agg)
        expected = reference_loss(lp, old, adv, mask, agg, clip_c=clip_c)
        assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_float32_and_float_mask_match_reference():
    lp, old, adv, mask = make_batch(7, dtype=torch.float32)
    loss, _ = policy_loss(lp, old, adv, mask.float())
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(reference_loss(lp, old, adv, mask, "token-mean"), rel=1e-5)


def test_asymmetric_clip_is_not_symmetric():
    """eps_low and eps_high are not interchangeable: a token at r = 1.25 with A > 0 is clipped only for eps_high < 0.25."""
    lp = torch.tensor([[math.log(1.25)]], dtype=torch.float64)
    old = torch.zeros(1, 1, dtype=torch.float64)
    adv = torch.ones(1, dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss_dapo, m_dapo = policy_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    loss_swapped, m_swapped = policy_loss(lp, old, adv, mask, eps_low=0.28, eps_high=0.2)
    assert loss_dapo.item() == pytest.approx(-1.25)
    assert loss_swapped.item() == pytest.approx(-1.2)
    assert m_dapo["clip_frac_high"].item() == 0.0 and m_swapped["clip_frac_high"].item() == 1.0


@pytest.mark.parametrize("clip_c", [CLIP_C, None])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_gradient_zero_exactly_where_clipped(clip_c, agg):
    lp, old, adv, mask = make_batch(11, per_token_adv=True)
    lp = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, old, adv, mask, clip_c=clip_c, agg=agg)
    loss.backward()
    grad = lp.grad
    r = torch.exp(lp.detach() - old)
    clipped_high = (adv > 0) & (r > 1 + EPS_HIGH)
    clipped_low = (adv < 0) & (r < 1 - EPS_LOW)
    clipped_dual = (adv < 0) & (r > CLIP_C) if clip_c is not None else torch.zeros_like(mask)
    clipped = (clipped_high | clipped_low | clipped_dual) & mask
    free = mask & ~clipped
    assert clipped_high.logical_and(mask).any() and clipped_low.logical_and(mask).any()
    assert ((adv < 0) & (r > CLIP_C) & mask).any()  # the dual regime is populated in both parametrizations
    assert (grad[clipped] == 0).all()
    assert (grad[~mask] == 0).all()
    assert (grad[free] != 0).all()
    # d loss / d logp = -A * r / denominator on unclipped tokens (token-mean)
    if agg == "token-mean":
        expected = -adv * r / mask.sum()
        torch.testing.assert_close(grad[free], expected[free], rtol=1e-12, atol=0)


def test_only_logprobs_receive_gradient():
    lp, old, adv, mask = make_batch(2, per_token_adv=True)
    lp, old, adv = (x.clone().requires_grad_(True) for x in (lp, old, adv))
    loss, metrics = policy_loss(lp, old, adv, mask)
    loss.backward()
    assert lp.grad is not None and old.grad is None and adv.grad is None
    assert all(not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("splits", [[2, 5, 1, 3], [1, 1, 9], [11]])
def test_micro_batch_sum_with_global_denominator_equals_full_batch(agg, splits):
    lp, old, adv, mask = make_batch(5, dtype=torch.float32)
    full_lp = lp.clone().requires_grad_(True)
    full, full_metrics = policy_loss(full_lp, old, adv, mask, agg=agg)
    full.backward()

    parts_lp = lp.clone().requires_grad_(True)
    bounds = torch.tensor([0, *splits]).cumsum(0).tolist()
    slices = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    denom = sum(loss_denominator(mask[s], agg) for s in slices)
    total, metrics = 0.0, []
    for s in slices:
        loss, m = policy_loss(parts_lp[s], old[s], adv[s], mask[s], agg=agg, denominator=denom)
        total = total + loss
        metrics.append(m)
    total.backward()
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(parts_lp.grad, full_lp.grad, rtol=1e-5, atol=1e-7)
    combined = combine_loss_metrics(metrics)
    for key, value in full_metrics.items():
        torch.testing.assert_close(combined[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_denominator_as_int_and_as_tensor_agree():
    lp, old, adv, mask = make_batch(3)
    a, _ = policy_loss(lp, old, adv, mask, denominator=1000)
    b, _ = policy_loss(lp, old, adv, mask, denominator=torch.tensor(1000))
    c, _ = policy_loss(lp, old, adv, mask)
    assert a.item() == pytest.approx(b.item(), rel=1e-14)
    assert a.item() * 1000 == pytest.approx(c.item() * int(mask.sum()), rel=1e-12)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_packed_rows_with_seq_ids_equal_unpacked(agg):
    lp, old, adv, mask = make_batch(4, per_token_adv=True)
    batch, seq = mask.shape
    # pack rows (0,1,2), (3,4,...,7), (8,9,10) side by side into 3 long rows, padded with masked tokens
    groups = [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9, 10]]
    width = max(len(g) for g in groups) * seq
    packed = {k: torch.zeros(len(groups), width, dtype=v.dtype) for k, v in dict(lp=lp, old=old, adv=adv).items()}
    packed_mask = torch.zeros(len(groups), width, dtype=torch.bool)
    seq_ids = torch.full((len(groups), width), -1, dtype=torch.int64)
    for row, members in enumerate(groups):
        for j, i in enumerate(members):
            cols = slice(j * seq, (j + 1) * seq)
            packed["lp"][row, cols], packed["old"][row, cols], packed["adv"][row, cols] = lp[i], old[i], adv[i]
            packed_mask[row, cols] = mask[i]
            seq_ids[row, cols] = i
    expected, _ = policy_loss(lp, old, adv, mask, agg=agg)
    got, _ = policy_loss(packed["lp"], packed["old"], packed["adv"], packed_mask, agg=agg, seq_ids=seq_ids)
    assert got.item() == pytest.approx(expected.item(), rel=1e-12)
    assert loss_denominator(packed_mask, agg, seq_ids) == loss_denominator(mask, agg) == int(mask.any(-1).sum())


@pytest.mark.parametrize("agg", AGG_MODES)
def test_ratio_one_gives_minus_mean_advantage_and_no_clipping(agg):
    lp, _, adv, mask = make_batch(9, per_token_adv=False)
    loss, m = policy_loss(lp, lp.clone(), adv, mask, agg=agg)
    rows = [(adv[i].item(), int(mask[i].sum())) for i in range(mask.shape[0]) if mask[i].any()]
    if agg == "token-mean":
        expected = -sum(a * n for a, n in rows) / sum(n for _, n in rows)
    elif agg == "seq-mean-token-mean":
        expected = -sum(a for a, _ in rows) / len(rows)
    else:
        expected = -sum(a * n for a, n in rows) / len(rows)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    for key in ("clip_frac_low", "clip_frac_high", "clip_frac_dual", "ppo_kl"):
        assert m[key].item() == 0.0, key
    for key in ("ratio_mean", "ratio_max", "ratio_min"):
        assert m[key].item() == 1.0, key


def test_metrics_match_reference_counts():
    lp, old, adv, mask = make_batch(12, per_token_adv=True)
    _, m = policy_loss(lp, old, adv, mask)
    low = high = dual = 0
    ratios, kls = [], []
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            a, d = adv[i, t].item(), lp[i, t].item() - old[i, t].item()
            r = math.exp(d)
            ratios.append(r)
            kls.append(-d)
            low += a < 0 and r < 1 - EPS_LOW
            high += a > 0 and r > 1 + EPS_HIGH
            dual += a < 0 and r > CLIP_C
    n = len(ratios)
    assert m["num_tokens"].item() == n
    assert low > 0 and high > 0 and dual > 0
    assert m["clip_frac_low"].item() == pytest.approx(low / n)
    assert m["clip_frac_high"].item() == pytest.approx(high / n)
    assert m["clip_frac_dual"].item() == pytest.approx(dual / n)
    assert m["ppo_kl"].item() == pytest.approx(sum(kls) / n)
    assert m["ratio_mean"].item() == pytest.approx(sum(ratios) / n)
    assert m["ratio_max"].item() == pytest.approx(max(ratios))
    assert m["ratio_min"].item() == pytest.approx(min(ratios))


@pytest.mark.parametrize("agg", AGG_MODES)
def test_all_masked_micro_batch_is_zero_and_finite(agg):
    lp, old, adv, _ = make_batch(1)
    lp[0, 0], old[0, 0] = 0.0, -math.inf  # garbage at masked positions must not leak
    old[1, 1] = math.nan
    mask = torch.zeros_like(lp, dtype=torch.bool)
    lp = lp.requires_grad_(True)
    loss, m = policy_loss(lp, old, adv, mask, agg=agg)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert (lp.grad == 0).all()
    assert all(torch.isfinite(v).all() for v in m.values())
    loss0, _ = policy_loss(lp, old, adv, mask, agg=agg, denominator=0)
    assert loss0.item() == 0.0


def test_extreme_log_ratio_stays_finite():
    lp = torch.tensor([[200.0, -200.0, 200.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = policy_loss(lp, old, adv, mask, clip_c=None)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v).all() for v in m.values())


def test_combine_metrics_ignores_empty_parts_for_extremes():
    lp, old, adv, mask = make_batch(8)
    _, full = policy_loss(lp, old, adv, mask)
    empty = torch.zeros_like(mask)
    _, a = policy_loss(lp[:4], old[:4], adv[:4], empty[:4])
    _, b = policy_loss(lp, old, adv, mask)
    combined = combine_loss_metrics([a, b])
    assert combined["ratio_min"].item() == full["ratio_min"].item() > 0
    assert combined["ratio_max"].item() == full["ratio_max"].item()


def test_bad_inputs_name_the_culprit():
    lp, old, adv, mask = make_batch(0)
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(lp, old[:, :-1], adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, old, adv[:-1], mask)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(lp, old, adv, mask[:-1])
    with pytest.raises(ValueError, match="algo.loss_agg"):
        policy_loss(lp, old, adv, mask, agg="sum")
    with pytest.raises(ValueError, match="algo.clip_c"):
        policy_loss(lp, old, adv, mask, clip_c=0.5)
    with pytest.raises(ValueError, match="denominator"):
        policy_loss(lp, old, adv, mask, denominator=-1)


def test_advantage_shapes_broadcast_alike():
    lp, old, adv, mask = make_batch(6)
    a, _ = policy_loss(lp, old, adv, mask)
    b, _ = policy_loss(lp, old, adv.unsqueeze(-1), mask)
    c, _ = policy_loss(lp, old, adv.unsqueeze(-1).expand_as(lp).contiguous(), mask)
    assert a.item() == b.item() == c.item()


def test_gradient_at_ratio_one_is_the_full_policy_gradient():
    """At r = 1 both branches of the max tie; the gradient must still be -A / n (not halved or doubled)."""
    lp, _, adv, mask = make_batch(10)
    lp = lp.requires_grad_(True)
    loss, _ = policy_loss(lp, lp.detach().clone(), adv, mask)
    loss.backward()
    expected = torch.where(mask, -adv.unsqueeze(-1) / mask.sum(), 0.0)
    torch.testing.assert_close(lp.grad, expected, rtol=1e-12, atol=0)


# ----------------------------------------------------------------------------------------------------------------------
# truncated importance sampling (rollout/train mismatch)


def _tis_reference(lp, old, rollout, adv, mask, eps_low, eps_high, clip_c, cap):
    """Plain Python, token by token: w = min(exp(old - rollout), cap) times the dual-clipped surrogate; token-mean."""
    total, count = 0.0, 0
    for i in range(len(lp)):
        for t in range(len(lp[i])):
            if not mask[i][t]:
                continue
            r = math.exp(lp[i][t] - old[i][t])
            a = adv[i]
            pg = max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high))
            if a < 0:
                pg = min(pg, -a * clip_c)
            total += pg * min(math.exp(old[i][t] - rollout[i][t]), cap)
            count += 1
    return total / count


def test_tis_matches_a_plain_python_reference():
    g = torch.Generator().manual_seed(3)
    lp = (-torch.rand(3, 6, generator=g, dtype=torch.float64) * 2).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(3, 6, generator=g, dtype=torch.float64)
    rollout = old + 0.8 * torch.randn(3, 6, generator=g, dtype=torch.float64)  # some weights above the cap 2.0
    adv = torch.tensor([1.5, -0.7, -2.0], dtype=torch.float64)
    mask = torch.rand(3, 6, generator=g) > 0.2
    loss, m = policy_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28, clip_c=3.0, rollout_logprobs=rollout,
                          tis_cap=2.0)  # fmt: skip
    ref = _tis_reference(lp.tolist(), old.tolist(), rollout.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, 3.0, 2.0)
    assert float(loss) == pytest.approx(ref, rel=1e-12)
    w = (old - rollout).exp()
    assert int(m["tis_capped_tokens"]) == int(((w > 2.0) & mask).sum()) > 0
    assert float(m["tis_max"]) == pytest.approx(float(w[mask].max()))
    assert float(m["tis_mean"]) == pytest.approx(float(w.clamp(max=2.0)[mask].mean()))
    # the weight is a constant: the gradient is the weighted surrogate's, nothing flows through it
    loss.backward()
    lp2 = lp.detach().clone().requires_grad_()
    plain, _ = policy_loss(lp2, old, adv, mask, eps_low=0.2, eps_high=0.28, clip_c=3.0, agg="token-mean")
    assert not torch.allclose(lp.grad, torch.autograd.grad(plain, lp2)[0])  # TIS changes the update


def test_tis_with_rollout_equal_to_old_is_no_correction():
    g = torch.Generator().manual_seed(4)
    lp = (-torch.rand(4, 5, generator=g) * 2).requires_grad_()
    old = lp.detach() + 0.2 * torch.randn(4, 5, generator=g)
    adv, mask = torch.randn(4, generator=g), torch.rand(4, 5, generator=g) > 0.3
    with_tis, m = policy_loss(lp, old, adv, mask, rollout_logprobs=old.clone(), tis_cap=2.0)
    (grad_tis,) = torch.autograd.grad(with_tis, lp)
    without, _ = policy_loss(lp, old, adv, mask)
    (grad_plain,) = torch.autograd.grad(without, lp)
    assert torch.equal(with_tis, without) and torch.equal(grad_tis, grad_plain)
    assert float(m["tis_mean"]) == 1.0 and int(m["tis_capped_tokens"]) == 0
    with pytest.raises(ValueError, match="go together"):
        policy_loss(lp, old, adv, mask, rollout_logprobs=old)
