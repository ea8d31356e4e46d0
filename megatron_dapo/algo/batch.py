"""From scored rollout groups to the actor's training sequences: reward shaping and group advantages.

A ``Group`` is one prompt with its G samples and their correctness; it is what the dynamic sampler keeps and what
rank 0 broadcasts to every rank (plain, picklable data).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_dapo.algo.advantage import group_advantages
from megatron_dapo.algo.shaping import overlong_filter_mask, overlong_penalty
from megatron_dapo.config.run_config import DapoConfig
from megatron_dapo.types import Sequence


@dataclass
class Group:
    prompt_ids: list[int]
    responses: list[list[int]]
    rollout_logprobs: list[list[float]]
    finish_reasons: list[str]
    scores: list[float]  # ±1 correctness reward
    correct: list[bool]
    data_source: str = ""
    texts: list[str] = field(default_factory=list)
    # partial rollout (loop/schedule.py): per sample, per response token, how many weight versions older than the
    # trainer's the weights it was sampled from are (0 = on-policy); empty = every token on-policy
    token_lag: list[list[int]] = field(default_factory=list)


def group_from_samples(prompt_ids: list[int], samples: list, results: list[dict], data_source: str) -> Group:
    return Group(
        prompt_ids=list(prompt_ids),
        responses=[list(s.response_ids) for s in samples],
        rollout_logprobs=[list(s.logprobs) for s in samples],
        finish_reasons=[s.finish_reason for s in samples],
        scores=[float(r["score"]) for r in results],
        correct=[bool(r["acc"]) for r in results],
        data_source=data_source,
        texts=[s.text for s in samples],
    )


def shaped_rewards(groups: list[Group], cfg: DapoConfig) -> torch.Tensor:
    """[B, G] rewards: correctness (±1) plus the soft overlong punishment when enabled."""
    scores = torch.tensor([g.scores for g in groups], dtype=torch.float32)
    if not cfg.algo.overlong_penalty:
        return scores
    lengths = torch.tensor([[len(r) for r in g.responses] for g in groups])
    penalty = overlong_penalty(
        lengths, cfg.rollout.sampling.max_new_tokens, cfg.algo.overlong_cache, cfg.algo.overlong_penalty_factor
    )
    return scores + penalty


def to_sequences(groups: list[Group], cfg: DapoConfig) -> tuple[list[Sequence], dict[str, float]]:
    """Training sequences (group-major, in order) with advantages and loss masks, and the batch's reward metrics."""
    rewards = shaped_rewards(groups, cfg)
    adv = group_advantages(rewards, eps=cfg.algo.adv_eps)
    seqs = []
    for g, row in zip(groups, adv):
        keep = overlong_filter_mask(torch.tensor([f == "length" for f in g.finish_reasons]))
        for j, resp in enumerate(g.responses):
            mask = torch.ones(len(resp))
            if cfg.algo.overlong_filter and not keep[j]:
                mask.zero_()
            seqs.append(
                Sequence(
                    tokens=torch.tensor(g.prompt_ids + resp, dtype=torch.long),
                    prompt_len=len(g.prompt_ids),
                    advantage=float(row[j]),
                    loss_mask=mask,
                    rollout_logprobs=_rollout_logprobs(g.rollout_logprobs[j], len(resp)),
                    tis_mask=_tis_mask(g, j, cfg),
                )
            )
    lengths = torch.tensor([float(len(r)) for g in groups for r in g.responses])
    truncated = torch.tensor([f == "length" for g in groups for f in g.finish_reasons], dtype=torch.float32)
    correct = torch.tensor([c for g in groups for c in g.correct], dtype=torch.float32)
    metrics = {
        "train/reward_mean": float(rewards.mean()),
        "train/score_mean": float(torch.tensor([g.scores for g in groups]).mean()),
        "train/acc_mean": float(correct.mean()),
        "train/response_len_mean": float(lengths.mean()),
        "train/response_len_max": float(lengths.max()),
        "train/truncated_frac": float(truncated.mean()),
        "train/adv_abs_mean": float(adv.abs().mean()),
    }
    return seqs, metrics


def _tis_mask(g: Group, j: int, cfg: DapoConfig) -> torch.Tensor | None:
    """Sample j's off-policy tokens, for TIS to weigh when it is on for those only (algo.tis auto, partial rollout);
    None when TIS weighs every token (algo.tis on, precisions differ) or none, or the sample is all on-policy."""
    if not g.token_lag or cfg.tis_enabled or not cfg.tis_possible or not any(g.token_lag[j]):
        return None
    if len(g.token_lag[j]) != len(g.responses[j]):
        raise ValueError(f"{len(g.token_lag[j])} version tags for a response of {len(g.responses[j])} tokens")
    return torch.tensor(g.token_lag[j]) > 0


def _rollout_logprobs(logprobs: list[float], length: int) -> torch.Tensor | None:
    """The engine's logprobs of one response, or None when it returned none (sampling without logprobs)."""
    if not logprobs:
        return None
    if len(logprobs) != length:
        raise ValueError(f"the rollout returned {len(logprobs)} logprobs for a response of {length} tokens")
    return torch.tensor(logprobs, dtype=torch.float32)


def logprob_gap_stats(groups: list[Group], actor_logprobs: list[torch.Tensor]) -> dict[str, float]:
    """Mean and max |logp_rollout − logp_actor| over response tokens (rollout/training mismatch), the tokens sampled
    from older weights (``Group.token_lag`` > 0: they differ by the policy's change, not by a mismatch) left out.

    The two must align token for token: a sequence whose rollout and actor logprobs differ in length (an off-by-one
    in the response offsets, a dropped EOS) is an error naming it, never silently left out of the statistic."""
    rollout = [(gi, j, lp) for gi, g in enumerate(groups) for j, lp in enumerate(g.rollout_logprobs)]
    if len(rollout) != len(actor_logprobs):
        raise ValueError(f"logprob gap: {len(rollout)} rollout sequences but {len(actor_logprobs)} actor sequences")
    gaps = []
    for (gi, j, r), a in zip(rollout, actor_logprobs):
        if len(r) != a.numel():
            raise ValueError(
                f"logprob gap: group {gi} sample {j} has {len(r)} rollout logprobs but the actor computed "
                f"{a.numel()} for it: rollout and training tokens are misaligned"
            )
        gap = (torch.tensor(r, dtype=torch.float32) - a.float()).abs()
        gaps.append(gap[torch.tensor(groups[gi].token_lag[j], dtype=torch.long) == 0] if groups[gi].token_lag else gap)
    flat = torch.cat(gaps) if gaps else torch.zeros(0)
    if not flat.numel():
        return {"train/logp_gap_mean": 0.0, "train/logp_gap_max": 0.0, "train/logp_gap_tokens": 0.0}
    return {
        "train/logp_gap_mean": float(flat.mean()),
        "train/logp_gap_max": float(flat.max()),
        "train/logp_gap_tokens": float(flat.numel()),
    }
