"""Group-relative advantages (GRPO / DAPO, arXiv 2503.14476, eq. 9).

For the G responses o_1..o_G to one prompt, with rewards R_1..R_G:

    Â_i = (R_i − mean({R_j})) / (std({R_j}) + eps)        std unbiased (divides by G − 1)

and Â_i applies to every token of o_i. A group whose rewards are all equal (or G = 1) carries no signal: its
advantages are exactly 0.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``rewards`` [groups, G] → advantages [groups, G], normalized within each group (row).

    Computed in float64 and returned in the dtype of ``rewards`` (float32 for integer rewards). Rows whose rewards
    are all equal give exact zeros (the float mean of equal values can be off by an ulp, which ``/ eps`` would
    blow up); G = 1 gives zeros, not NaN.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; expected [groups, G]")
    if eps <= 0:
        raise ValueError(f"eps = {eps}: must be > 0 (config key algo.adv_eps)")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    r = rewards.to(torch.float64)
    if not torch.isfinite(r).all():
        bad = (~torch.isfinite(r)).nonzero()[0].tolist()
        raise ValueError(f"rewards[{bad[0]}, {bad[1]}] is not finite")
    if r.shape[1] < 2:
        return torch.zeros_like(r, dtype=out_dtype)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, correction=1)
    adv = (r - mean) / (std + eps)
    constant = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    adv = torch.where(constant, 0.0, adv)
    return adv.to(out_dtype)


def token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sample advantages over the response tokens: [groups, G] or [n] with mask [n, seq] → [n, seq].

    [groups, G] is flattened group-major (all G samples of group 0 first), which must be the row order of ``mask``.
    Positions where ``mask`` is 0 get 0.
    """
    flat = advantages.reshape(-1)
    if mask.dim() != 2 or mask.shape[0] != flat.shape[0]:
        raise ValueError(
            f"mask has shape {tuple(mask.shape)}; expected [{flat.shape[0]}, seq] (one row per sample of advantages "
            f"{tuple(advantages.shape)})"
        )
    valid = mask if mask.dtype == torch.bool else mask != 0
    return torch.where(valid, flat.unsqueeze(-1), torch.zeros((), dtype=flat.dtype, device=flat.device))
