"""Rollout/train mismatch corrections: how much each token's loss counts when the samples came from π_rollout (another
engine, precision or kernels, or older weights) rather than π_old. One small pure function per correction, registered
by name (``algo.correction``; a user's ``"package.module:function"`` plugs in the same way).

Each takes, over the tokens to correct (flattened, the batch's valid tokens in order):

    log_ratio  [n]  ρ_t = log π_old(y_t) − log π_rollout(y_t)          (detached)
    seq        [n]  the index of each token's sequence (0 .. num_seqs − 1)
    num_seqs        the number of sequences

and returns the weights w_t [n] ≥ 0 that multiply the tokens' policy-gradient losses (0 = the token is masked out of
the loss; it still counts in the loss's token denominator, as a weight of 0 does). With S_i = Σ_{t∈i} ρ_t and
|i| the tokens of sequence i:

    token_tis   w_t = min(e^{ρ_t}, C)                                   (verl rollout_is=token, slime vanilla TIS)
    seq_tis     w_t = min(e^{S_i}, C)                                    (verl rollout_is=sequence)
    token_mis   w_t = e^{ρ_t} if lo ≤ e^{ρ_t} ≤ hi else 0                (slime / AReaL masked IS, token level)
    seq_mis     w_t = e^{S_i} if lo ≤ e^{S_i} ≤ hi else 0                (masked IS, sequence level)
    icepop      w_t = 1 if lo ≤ e^{ρ_t} ≤ hi else 0                      (IcePop's two-sided token masking, verl
                                                                          rollout_rs=token: rejection, no reweighting)
    geo_reject  w_t = 1 if lo ≤ e^{S_i/|i|} ≤ hi else 0                  (geometric-mean sequence rejection, verl
                                                                          rollout_rs=geometric)

C is ``algo.tis_cap``; [lo, hi] is ``algo.correction_bounds``. Log-ratios are clamped to ±20 before exp (verl's
SAFETY_BOUND), so an impossible token cannot overflow.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SAFE = 20.0  # exp() bound on a log-ratio (a token beyond it is capped, masked or rejected anyway)


def _exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.clamp(-SAFE, SAFE))


def _per_seq_sum(values: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq, values)


def _inside(x: torch.Tensor, bounds: tuple[float, float]) -> torch.Tensor:
    lo, hi = bounds
    return (x >= lo) & (x <= hi)


def token_tis(log_ratio, seq, num_seqs, *, cap: float = 2.0, bounds=None) -> torch.Tensor:
    """Truncated importance sampling per token: min(π_old/π_rollout, C)."""
    return _exp(log_ratio).clamp(max=cap)


def seq_tis(log_ratio, seq, num_seqs, *, cap: float = 2.0, bounds=None) -> torch.Tensor:
    """Truncated importance sampling per sequence: every token of i weighs min(Π_t π_old/π_rollout, C)."""
    return _exp(_per_seq_sum(log_ratio, seq, num_seqs)).clamp(max=cap)[seq]


def token_mis(log_ratio, seq, num_seqs, *, cap=None, bounds=(0.5, 2.0)) -> torch.Tensor:
    """Masked importance sampling per token: the ratio where it lies within the bounds, 0 outside."""
    w = _exp(log_ratio)
    return torch.where(_inside(w, bounds), w, torch.zeros_like(w))


def seq_mis(log_ratio, seq, num_seqs, *, cap=None, bounds=(0.5, 2.0)) -> torch.Tensor:
    """Masked importance sampling per sequence: the sequence's ratio where within the bounds, else the whole sequence
    masked."""
    w = _exp(_per_seq_sum(log_ratio, seq, num_seqs))
    return torch.where(_inside(w, bounds), w, torch.zeros_like(w))[seq]


def icepop(log_ratio, seq, num_seqs, *, cap=None, bounds=(0.5, 2.0)) -> torch.Tensor:
    """Two-sided token masking: tokens whose ratio leaves the bounds are masked, the rest weigh 1."""
    return _inside(_exp(log_ratio), bounds).to(log_ratio.dtype)


def geo_reject(log_ratio, seq, num_seqs, *, cap=None, bounds=(0.5, 2.0)) -> torch.Tensor:
    """Geometric-mean rejection: a sequence whose per-token geometric-mean ratio leaves the bounds is masked whole
    (length-neutral, unlike the product), the rest weigh 1."""
    ones = torch.ones_like(log_ratio)
    geo = _exp(_per_seq_sum(log_ratio, seq, num_seqs) / _per_seq_sum(ones, seq, num_seqs).clamp(min=1))
    return _inside(geo, bounds).to(log_ratio.dtype)[seq]


CORRECTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "token_tis": token_tis,
    "seq_tis": seq_tis,
    "token_mis": token_mis,
    "seq_mis": seq_mis,
    "icepop": icepop,
    "geo_reject": geo_reject,
}

PER_SEQUENCE = frozenset({"seq_tis", "seq_mis", "geo_reject"})  # need every token of a sequence on one rank (CP 1)


def correction_named(name: str) -> Callable[..., torch.Tensor]:
    """A registered correction, or a user's ``"package.module:function"`` with the same signature."""
    if name in CORRECTIONS:
        return CORRECTIONS[name]
    if ":" in name:
        from megatron_dapo.config.plugins import load_callable

        return load_callable(name, "algo.correction")
    raise ValueError(
        f"algo.correction = {name!r}: expected one of {', '.join(CORRECTIONS)} or 'package.module:function'"
    )


def check_correction(name: str, cp: int) -> None:
    """At start-up: the name resolves, and a sequence-level correction sees whole sequences (context parallelism
    splits each sequence over ``cp`` ranks, whose sums would be partial)."""
    correction_named(name)
    if name in PER_SEQUENCE and cp > 1:
        raise ValueError(
            f"algo.correction = {name!r} weighs whole sequences, but parallel.cp = {cp} splits each sequence over "
            "ranks: use a token-level correction (token_tis, token_mis, icepop) or cp = 1"
        )
