"""The mismatch corrections (algo/corrections.py), each against a plain-Python reference written from its formula in
the module docstring; and through the loss: the weights multiply each token's loss, masked tokens add nothing."""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_dapo.algo import corrections as C
from megatron_dapo.algo.loss import policy_loss

BOUNDS = (0.5, 2.0)
CAP = 2.0


def inside(x):
    return BOUNDS[0] <= x <= BOUNDS[1]


def reference(name: str, rows: list[list[float]]) -> list[list[float]]:
    """Per sequence (a list of log-ratios log pi_old - log pi_rollout), each token's weight."""
    out = []
    for rho in rows:
        s = sum(rho)
        if name == "token_tis":
            out.append([min(math.exp(r), CAP) for r in rho])
        elif name == "seq_tis":
            out.append([min(math.exp(s), CAP)] * len(rho))
        elif name == "token_mis":
            out.append([math.exp(r) if inside(math.exp(r)) else 0.0 for r in rho])
        elif name == "seq_mis":
            out.append([math.exp(s) if inside(math.exp(s)) else 0.0] * len(rho))
        elif name == "icepop":
            out.append([1.0 if inside(math.exp(r)) else 0.0 for r in rho])
        elif name == "geo_reject":
            out.append([1.0 if inside(math.exp(s / len(rho))) else 0.0] * len(rho))
    return out


def batch(seed=0, n=12):
    rng = random.Random(seed)
    # log-ratios around 0 with tails both ways: some tokens and sequences cross every bound
    return [[rng.gauss(0, 0.5) * (3 if rng.random() < 0.15 else 1) for _ in range(rng.randint(1, 9))] for _ in range(n)]


@pytest.mark.parametrize("name", sorted(C.CORRECTIONS))
def test_each_correction_matches_its_plain_python_reference(name):
    seen = set()
    for seed in range(5):
        rows = batch(seed)
        flat = torch.tensor([r for row in rows for r in row], dtype=torch.float64)
        seq = torch.tensor([i for i, row in enumerate(rows) for _ in row])
        got = C.CORRECTIONS[name](flat, seq, len(rows), cap=CAP, bounds=BOUNDS)
        want = [w for row in reference(name, rows) for w in row]
        assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12), (name, seed)
        seen |= {"zero" if w == 0 else "cap" if w == CAP else "kept" for w in want}
    # the data reaches every branch: masked and kept tokens, capped ones for TIS
    assert seen == ({"cap", "kept"} if name.endswith("tis") else {"zero", "kept"}), seen


def test_through_the_loss_each_token_is_weighted_and_masked_tokens_add_nothing():
    """Packed rows (seq_ids) as the actor passes them: the loss equals the plain per-token DAPO loss times the
    reference weights, summed over the batch's token count (rejected tokens count in the denominator: weight 0)."""
    torch.manual_seed(0)
    rows = batch(3, n=6)
    lens = [len(r) for r in rows]
    T = sum(lens)
    old = torch.randn(1, T, dtype=torch.float64) * 0.1 - 1.0
    rollout = old - torch.tensor([[r for row in rows for r in row]], dtype=torch.float64)
    lp = (old + torch.randn(1, T, dtype=torch.float64) * 0.05).requires_grad_()
    adv = torch.tensor([[a for i, n in enumerate(lens) for a in [(-1.0) ** i] * n]], dtype=torch.float64)
    seq_ids = torch.tensor([[i for i, n in enumerate(lens) for _ in range(n)]])
    mask = torch.ones(1, T, dtype=torch.bool)
    for name in sorted(C.CORRECTIONS):
        loss, m = policy_loss(lp, old, adv, mask, clip_c=None, seq_ids=seq_ids, rollout_logprobs=rollout,
                              tis_cap=CAP, correction=name, correction_bounds=BOUNDS)  # fmt: skip
        weights = [w for row in reference(name, rows) for w in row]
        total = 0.0
        for t in range(T):
            r = math.exp(lp[0, t].item() - old[0, t].item())
            a = adv[0, t].item()
            total += max(-a * r, -a * min(max(r, 0.8), 1.28)) * weights[t]
        assert loss.item() == pytest.approx(total / T, rel=1e-9), name
        assert m["tis_masked_tokens"].item() == sum(w == 0 for w in weights), name
        (g,) = torch.autograd.grad(loss, lp)
        assert all(g[0, t].item() == 0 for t in range(T) if weights[t] == 0), name  # masked: no gradient


def test_a_user_correction_plugs_in_by_reference_and_bad_weights_are_refused(tmp_path, monkeypatch):
    (tmp_path / "my_corr.py").write_text(
        "import torch\n"
        "def half(log_ratio, seq, num_seqs, *, cap=None, bounds=None):\n"
        "    return torch.full_like(log_ratio, 0.5)\n"
        "def negative(log_ratio, seq, num_seqs, *, cap=None, bounds=None):\n"
        "    return -torch.ones_like(log_ratio)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    lp, old = torch.zeros(1, 3), torch.zeros(1, 3)
    adv, mask = torch.ones(1), torch.ones(1, 3, dtype=torch.bool)
    plain, _ = policy_loss(lp, old, adv, mask)
    halved, m = policy_loss(lp, old, adv, mask, rollout_logprobs=old, tis_cap=2.0, correction="my_corr:half")
    assert halved.item() == pytest.approx(plain.item() / 2) and m["tis_mean"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="my_corr:negative"):
        policy_loss(lp, old, adv, mask, rollout_logprobs=old, tis_cap=2.0, correction="my_corr:negative")
    with pytest.raises(ValueError, match="algo.correction = 'nope'"):
        C.check_correction("nope", 1)
    with pytest.raises(ValueError, match="parallel.cp = 2"):
        C.check_correction("seq_tis", 2)
    C.check_correction("token_mis", 2)
