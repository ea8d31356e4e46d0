"""DAPO policy loss: decoupled clip ("clip-higher"), optional dual clip, token-level aggregation.

For a valid response token t of sample i (DAPO, arXiv 2503.14476, eq. 8; dual clip from Ye et al. 2020):

    r_t  = exp(logp_t − logp_old_t)
    pg_t = max(−A_i · r_t,  −A_i · clip(r_t, 1 − ε_low, 1 + ε_high))
    pg_t = min(pg_t, −A_i · c)                        only where A_i < 0 (dual clip; c = ``clip_c``, None = off)

Aggregation (``agg``) of the per-token losses over the valid tokens of the batch:

    "token-mean"            Σ_i Σ_t pg_t / Σ_i |y_i|              (DAPO, eq. 8: every token weighs the same)
    "seq-mean-token-mean"   (1/N) Σ_i (1/|y_i|) Σ_t pg_t           (GRPO: every sequence weighs the same)
    "seq-mean-token-sum"    (1/N) Σ_i Σ_t pg_t                     (Dr. GRPO style; no length normalization)

|y_i| is the number of valid tokens of sample i and N the number of sequences with at least one valid token: a row
whose tokens are all masked (padding, or a truncated sample dropped by the overlong filter) neither adds to the loss
nor dilutes it. The denominator (Σ|y_i| for token-mean, N for the seq-mean variants) can be passed in as a GLOBAL
count over all micro-batches and data-parallel ranks (see :func:`loss_denominator`): then the sum of the micro-batch
losses equals the full-batch loss exactly, whatever the split. Sequences must not be split across micro-batches.

Packed rows: pass ``seq_ids`` ([batch, seq] integers) to say which sequence each token belongs to, when one row holds
several sequences; without it each row is one sequence. Only the seq-mean variants look at it.

Rollout/train mismatch (truncated importance sampling; verl ``rollout_corr_helper.py`` token level, slime
``vanilla_tis_function``): when the rollout engine's logprobs ``rollout_logprobs`` are given with ``tis_cap`` C, each
token's loss pg_t is multiplied by the constant weight w_t = min(exp(logp_old_t − logp_rollout_t), C), which corrects
for sampling from π_rollout (another precision, other kernels) while the ratio r_t is taken against π_old.
``tis_mask`` restricts the weights to some tokens (the others weigh 1): partial rollout corrects only the tokens
sampled from older weights than π_old (the proximal policy; verl ``rollout_corr``, AReaL decoupled PPO). Token TIS is
one of a family (``correction``: sequence TIS, masked IS, IcePop masking, geometric-mean rejection;
``algo/corrections.py``).

Metrics are computed over the valid tokens, without gradient. Besides the means they hold summable counts, so
micro-batches (or ranks, after an all-gather) combine exactly with :func:`combine_loss_metrics`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# exp() of a log-ratio beyond this would overflow toward inf and turn a zero gradient into NaN (0 · inf). At e^20 the
# token is clipped anyway (high clip for A > 0, dual clip for A < 0), so clamping changes no loss or gradient that
# matters; with the dual clip off, a token with A < 0 and log-ratio > 20 gets a zero gradient instead of a huge one.
MAX_LOG_RATIO = 20.0

# The summable entries of the metrics dict and how to reduce each over micro-batches / ranks.
LOSS_METRIC_REDUCTIONS = {
    "num_tokens": "sum",
    "clip_low_tokens": "sum",
    "clip_high_tokens": "sum",
    "clip_dual_tokens": "sum",
    "ppo_kl_sum": "sum",
    "ratio_sum": "sum",
    "ratio_max": "max",  # over micro-batches with num_tokens > 0
    "ratio_min": "min",  # over micro-batches with num_tokens > 0
    "tis_sum": "sum",  # importance weights (after the cap); 0 without TIS
    "tis_capped_tokens": "sum",
    "tis_max": "max",  # before the cap: how far the rollout strays
    "tis_tokens": "sum",  # tokens weighted (all valid ones without a tis_mask)
    "tis_masked_tokens": "sum",  # weighted tokens the correction masked (weight 0: MIS, IcePop, rejection)
    "tis_min": "min",  # before the correction, over the weighted tokens
}


def _check_agg(agg: str) -> None:
    if agg not in AGG_MODES:
        raise ValueError(f"agg = {agg!r}: must be one of {', '.join(AGG_MODES)} (config key algo.loss_agg)")


def _valid_mask(mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if mask.shape != shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {tuple(shape)} (the shape of logprobs)")
    return mask if mask.dtype == torch.bool else mask != 0


def _sequence_index(valid: torch.Tensor, seq_ids: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """For each valid token (in ``valid[valid]`` order) the index of its sequence; and the number of sequences."""
    if seq_ids is None:
        rows = torch.arange(valid.shape[0], device=valid.device).unsqueeze(-1).expand_as(valid)
        ids = rows[valid]
    else:
        if seq_ids.shape != valid.shape:
            raise ValueError(f"seq_ids has shape {tuple(seq_ids.shape)}; expected {tuple(valid.shape)} (as logprobs)")
        ids = seq_ids[valid]
    uniq, inverse = torch.unique(ids, return_inverse=True)
    return inverse, int(uniq.numel())


def loss_denominator(mask: torch.Tensor, agg: str = "token-mean", seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The local count to sum over micro-batches and DP ranks and pass back as ``policy_loss(denominator=...)``.

    token-mean: the number of valid tokens, Σ_i |y_i|. seq-mean variants: the number of sequences with at least one
    valid token (rows, or distinct ``seq_ids``). Returned as a 0-dim int64 tensor (exact beyond 2^24, all-reducible).
    """
    _check_agg(agg)
    valid = mask if mask.dtype == torch.bool else mask != 0
    if agg == "token-mean":
        return valid.sum(dtype=torch.int64)
    if seq_ids is None:
        return valid.any(dim=-1).sum(dtype=torch.int64)
    _, n = _sequence_index(valid, seq_ids)
    return torch.tensor(n, dtype=torch.int64, device=mask.device)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    clip_c: float | None = 10.0,
    agg: str = "token-mean",
    denominator: int | float | torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    tis_mask: torch.Tensor | None = None,
    correction: str = "token_tis",
    correction_bounds: tuple[float, float] = (0.5, 2.0),
    correction_reference: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DAPO clipped policy-gradient loss (see the module docstring for the equations).

    Args:
        logprobs: [batch, seq] log-probabilities of the sampled tokens under the current policy (the only input that
            receives gradient).
        old_logprobs: [batch, seq] the same under the policy that generated the rollout (detached here).
        advantages: [batch] or [batch, 1] (one per sample, broadcast over tokens) or [batch, seq] (detached here).
        mask: [batch, seq] bool or 0/1 float, 1 on valid response tokens. Values at masked positions are ignored,
            even inf/NaN.
        eps_low, eps_high: the decoupled clip range [1 − eps_low, 1 + eps_high].
        clip_c: dual-clip constant (> 1) bounding the loss of A < 0 tokens at −A·c; None turns it off.
        agg: "token-mean" | "seq-mean-token-mean" | "seq-mean-token-sum".
        denominator: the global :func:`loss_denominator` summed over all micro-batches and ranks; None = local count.
            A denominator of 0 (nothing valid anywhere) gives a loss of 0.
        seq_ids: [batch, seq] sequence index of each token for packed rows (seq-mean variants only).
        rollout_logprobs, tis_cap: the rollout engine's logprobs [batch, seq] and the cap C of the truncated
            importance weights (both, or neither).
        tis_mask: [batch, seq] bool, the tokens the weights apply to (None = every valid token; the rest weigh 1).
        correction, correction_bounds: which mismatch correction weighs the tokens (``algo/corrections.py``;
            token_tis = min(π_old/π_rollout, tis_cap)) and the bounds of the masking ones.
        correction_reference: [batch, seq] with π_old taken from the rollout (``old_logprobs`` = π_rollout), the
            current policy's detached logprobs: the correction compares them with π_rollout and acts as a rejection
            only (its zero weights mask tokens, the others weigh 1), since the PPO ratio π/π_rollout already carries
            the mismatch (verl's bypass mode); reweighting again would count it twice. None = compare π_old.

    Returns:
        (loss, metrics): a 0-dim loss (float32, or float64 for float64 inputs) and a dict of 0-dim detached tensors:
        clip_frac_low (A < 0 and r < 1 − eps_low: the low clip bound wins the max), clip_frac_high (A > 0 and
        r > 1 + eps_high), clip_frac_dual (A < 0 and r > clip_c), ppo_kl (mean of old_logprobs − logprobs),
        ratio_mean, ratio_max, ratio_min (0 when nothing is valid), and the summable forms listed in
        ``LOSS_METRIC_REDUCTIONS`` (combine them with :func:`combine_loss_metrics`).
    """
    _check_agg(agg)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs has shape {tuple(logprobs.shape)}; expected [batch, seq]")
    shape = logprobs.shape
    if old_logprobs.shape != shape:
        raise ValueError(f"old_logprobs has shape {tuple(old_logprobs.shape)}; expected {tuple(shape)} (as logprobs)")
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != shape and advantages.shape != (shape[0], 1):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}; expected [{shape[0]}], [{shape[0]}, 1] or "
            f"{tuple(shape)} (as logprobs)"
        )
    if not 0 < eps_low < 1:
        raise ValueError(f"eps_low = {eps_low}: must be in (0, 1) (config key algo.eps_low)")
    if eps_high <= 0:
        raise ValueError(f"eps_high = {eps_high}: must be > 0 (config key algo.eps_high)")
    if clip_c is not None and clip_c <= 1:
        raise ValueError(f"clip_c = {clip_c}: must be > 1 or None (config key algo.clip_c)")
    valid = _valid_mask(mask, shape)

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    adv = torch.where(valid, advantages.detach().to(dtype), 0.0)
    log_ratio = torch.where(valid, logprobs.to(dtype) - old_logprobs.detach().to(dtype), 0.0)
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))

    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    if clip_c is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * clip_c), pg)
    tis, corrected, weighted = None, None, valid
    if (rollout_logprobs is None) != (tis_cap is None):
        raise ValueError("rollout_logprobs and tis_cap go together (truncated importance sampling)")
    if rollout_logprobs is not None:
        if rollout_logprobs.shape != shape:
            raise ValueError(f"rollout_logprobs has shape {tuple(rollout_logprobs.shape)}; expected {tuple(shape)}")
        if tis_mask is not None:
            if tis_mask.shape != shape:
                raise ValueError(f"tis_mask has shape {tuple(tis_mask.shape)}; expected {tuple(shape)}")
            weighted = valid & (tis_mask if tis_mask.dtype == torch.bool else tis_mask != 0)
        reference = old_logprobs if correction_reference is None else correction_reference
        if reference.shape != shape:
            raise ValueError(f"correction_reference has shape {tuple(reference.shape)}; expected {tuple(shape)}")
        tis = truncated_is_weights(reference, rollout_logprobs, weighted, dtype)
        corrected = correction_weights(
            correction,
            tis_log_ratio(reference, rollout_logprobs, weighted, dtype),
            weighted,
            seq_ids,
            cap=tis_cap,
            bounds=tuple(correction_bounds),
        )
        if correction_reference is not None:
            corrected = (corrected > 0).to(corrected.dtype)  # rejection only (see correction_reference)
        pg = pg * corrected
    pg = torch.where(valid, pg, 0.0)

    if agg == "token-mean":
        total = pg.sum()
        local = valid.sum(dtype=torch.int64)
    else:
        inverse, num_seqs = _sequence_index(valid, seq_ids)
        seq_sum = torch.zeros(num_seqs, dtype=dtype, device=pg.device).index_add(0, inverse, pg[valid])
        if agg == "seq-mean-token-mean":
            seq_len = torch.zeros(num_seqs, dtype=dtype, device=pg.device).index_add(
                0, inverse, torch.ones_like(inverse, dtype=dtype)
            )
            seq_sum = seq_sum / seq_len
        # pg.sum() * 0 keeps the graph connected (zero gradient) when no token is valid.
        total = seq_sum.sum() + pg.sum() * 0.0
        local = torch.tensor(num_seqs, dtype=torch.int64, device=pg.device)

    if denominator is None:
        denominator = local
    if isinstance(denominator, torch.Tensor):
        denom = denominator.to(device=pg.device, dtype=dtype)
        denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    else:
        if denominator < 0:
            raise ValueError(f"denominator = {denominator}: must be >= 0")
        denom = denominator if denominator > 0 else 1
    loss = total / denom

    with torch.no_grad():
        metrics = _metrics(valid, adv, ratio, log_ratio, eps_low, eps_high, clip_c, tis, corrected, weighted)
    return loss, metrics


def correction_weights(
    correction: str, log_w: torch.Tensor, weighted: torch.Tensor, seq_ids: torch.Tensor | None, **args
) -> torch.Tensor:
    """[batch, seq] weights of the named correction over the ``weighted`` tokens (1 elsewhere); ``log_w`` the clamped
    log-ratios log π_old − log π_rollout. Sequences are rows, or ``seq_ids`` for packed rows."""
    from megatron_dapo.algo.corrections import correction_named

    out = torch.ones_like(log_w)
    if not bool(weighted.any()):
        return out
    seq, num_seqs = _sequence_index(weighted, seq_ids)
    w = correction_named(correction)(log_w[weighted], seq, num_seqs, **args)
    if w.shape != seq.shape or bool((w < 0).any()) or not bool(torch.isfinite(w).all()):
        raise ValueError(f"algo.correction = {correction!r}: expected {seq.numel()} finite weights >= 0")
    out[weighted] = w.to(out.dtype)
    return out


def truncated_is_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """exp(logp_old − logp_rollout) per token, detached, 1 where not ``valid`` (uncapped; the caller caps at C).

    The log-ratio is clamped to ±``MAX_LOG_RATIO`` as verl does (its SAFETY_BOUND), so a token the rollout engine
    found near-impossible cannot overflow; the cap makes any such weight C anyway."""
    return torch.exp(tis_log_ratio(old_logprobs, rollout_logprobs, valid, dtype))


def tis_log_ratio(old_logprobs, rollout_logprobs, valid, dtype) -> torch.Tensor:
    """log π_old − log π_rollout per token, detached, clamped to ±``MAX_LOG_RATIO``, 0 where not ``valid``."""
    log_w = torch.where(valid, old_logprobs.detach().to(dtype) - rollout_logprobs.detach().to(dtype), 0.0)
    return log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _metrics(valid, adv, ratio, log_ratio, eps_low, eps_high, clip_c, tis=None, corrected=None, weighted=None) -> dict:
    n = valid.sum(dtype=torch.int64)
    low = (valid & (adv < 0) & (ratio < 1.0 - eps_low)).sum(dtype=torch.int64)
    high = (valid & (adv > 0) & (ratio > 1.0 + eps_high)).sum(dtype=torch.int64)
    if clip_c is not None:
        dual = (valid & (adv < 0) & (ratio > clip_c)).sum(dtype=torch.int64)
    else:
        dual = torch.zeros_like(n)
    any_valid = n > 0
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    sums = {
        "num_tokens": n,
        "clip_low_tokens": low,
        "clip_high_tokens": high,
        "clip_dual_tokens": dual,
        "ppo_kl_sum": torch.where(valid, -log_ratio, 0.0).sum(),
        "ratio_sum": torch.where(valid, ratio, 0.0).sum(),
        # ratios are > 0, so 0 is neutral for the max; +inf for the min, replaced by 0 when nothing is valid.
        "ratio_max": torch.where(valid, ratio, 0.0).amax() if ratio.numel() else zero,
        "ratio_min": torch.where(any_valid, torch.where(valid, ratio, torch.inf).amin(), zero)
        if ratio.numel()
        else zero,
        "tis_sum": zero,
        "tis_capped_tokens": torch.zeros_like(n),
        "tis_max": zero,
        "tis_tokens": torch.zeros_like(n),
        "tis_masked_tokens": torch.zeros_like(n),
        "tis_min": zero,
    }
    if tis is not None:
        sums["tis_sum"] = torch.where(weighted, corrected, 0.0).sum()
        # tokens the correction changed (capped, masked or reweighted away from the plain ratio)
        sums["tis_capped_tokens"] = (weighted & ~torch.isclose(corrected, tis)).sum(dtype=torch.int64)
        sums["tis_masked_tokens"] = (weighted & (corrected == 0)).sum(dtype=torch.int64)
        sums["tis_max"] = torch.where(weighted, tis, 0.0).amax() if tis.numel() else zero
        any_weighted = weighted.any()
        low = torch.where(weighted, tis, torch.inf).amin() if tis.numel() else zero
        sums["tis_min"] = torch.where(any_weighted, low, zero)
        sums["tis_tokens"] = weighted.sum(dtype=torch.int64)
    return loss_metrics_from_sums(sums)


def loss_metrics_from_sums(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The metrics dict (means + the summable entries) from the summable entries alone."""
    n = sums["num_tokens"]
    denom = torch.clamp(n, min=1).to(sums["ratio_sum"].dtype)
    weighted = torch.clamp(sums["tis_tokens"], min=1).to(denom.dtype)
    out = {
        "clip_frac_low": sums["clip_low_tokens"] / denom,
        "clip_frac_high": sums["clip_high_tokens"] / denom,
        "clip_frac_dual": sums["clip_dual_tokens"] / denom,
        "ppo_kl": sums["ppo_kl_sum"] / denom,
        "ratio_mean": sums["ratio_sum"] / denom,
        "tis_mean": sums["tis_sum"] / weighted,  # over the weighted tokens
        "tis_capped_frac": sums["tis_capped_tokens"] / weighted,
        "tis_token_frac": sums["tis_tokens"] / denom,
        "tis_masked_frac": sums["tis_masked_tokens"] / weighted,
    }
    out.update({k: sums[k] for k in LOSS_METRIC_REDUCTIONS})
    return {k: v.detach() for k, v in out.items()}


def combine_loss_metrics(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Exactly combine the metrics of several micro-batches (or of all ranks, after an all-gather) into one dict.

    The result equals the metrics ``policy_loss`` would report for the concatenated batch. Parts without valid tokens
    are ignored for ratio_max / ratio_min.
    """
    if not parts:
        raise ValueError("combine_loss_metrics: no metrics to combine")
    sums: dict[str, torch.Tensor] = {}
    nonempty = [p for p in parts if int(p["num_tokens"]) > 0]
    for key, how in LOSS_METRIC_REDUCTIONS.items():
        if how == "sum":
            sums[key] = torch.stack([p[key] for p in parts]).sum()
        elif nonempty:
            values = torch.stack([p[key] for p in nonempty])
            sums[key] = values.amax() if how == "max" else values.amin()
        else:
            sums[key] = torch.zeros_like(parts[0][key])
    return loss_metrics_from_sums(sums)


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, denominator: int | float | torch.Tensor | None = None):
    """Token-mean negative log-likelihood, −Σ_t m_t·log p(y_t) / N, for a supervised warm start.

    ``denominator`` is the global token count N across micro-batches and ranks (None = the local count), as in
    :func:`policy_loss`, so micro-batch losses sum to the full-batch loss.
    """
    valid = (mask if mask.dtype == torch.bool else mask != 0).to(logprobs.dtype)
    denom = valid.sum() if denominator is None else denominator
    return -(logprobs * valid).sum() / max(float(denom), 1.0)
