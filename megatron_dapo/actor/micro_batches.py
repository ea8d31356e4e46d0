"""The actor's micro-batches: how many tokens one holds (``micro_batch_budget``) and the per-position arrays of a packed
one (``per_position_arrays``)."""

from __future__ import annotations

import torch

from megatron_dapo.actor.provider import DTYPES
from megatron_dapo.config.run_config import DapoConfig
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.engines.registry import engine_spec
from megatron_dapo.models.arch import ArchConfig
from megatron_dapo.types import Sequence


def micro_batch_budget(cfg: DapoConfig, arch: ArchConfig, layout: str, dp: int) -> tuple[int, str]:
    """(tokens per micro-batch, a line saying why): ``parallel.max_tokens_per_micro_batch``, or when None the largest
    budget whose predicted peak (``memory.actor_memory``) fits this rank's share of the memory; a given budget that is
    predicted not to fit is refused with the prediction. CPU: available RAM ÷ local ranks; GPU: 90% of the device."""
    import os

    from megatron_dapo.actor.provider import rehearsing
    from megatron_dapo.models.memory import GiB, actor_memory, fit_micro_batch_tokens

    p = cfg.parallel
    if rehearsing():  # the GPU job's rank, on a CPU: the GPU it will run on
        available = 0.9 * cfg.cluster.gpu_mem_gb * GiB
        where = "of the recipe's GPU (cluster.gpu_mem_gb)"
    elif torch.cuda.is_available():
        available = 0.9 * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        where = "of the GPU"
    else:
        import psutil

        available = 0.85 * psutil.virtual_memory().available / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        where = "of the available RAM for this rank"
    in_process_engine = not engine_spec(cfg.rollout.engine).servers and not torch.cuda.is_available()
    kw = dict(
        dtype_bytes=DTYPES[cfg.model.dtype].itemsize,
        tp=p.tp,
        pp=p.pp,
        dp=dp,
        layout=layout,
        recompute=cfg.model.recompute or "none",
        distributed_optimizer=bool(p.distributed_optimizer),
        logprob_chunk_tokens=p.logprob_chunk_tokens,
        engine_bytes_per_param=4 if in_process_engine else 0,
        lora_rank=cfg.model.lora.rank,
        lora_targets=tuple(cfg.model.lora.targets),
    )
    # the longest row the dense attention spans: a sequence, or a group's responses behind their shared prompt
    row = cfg.max_seq_len
    if layout == "padded" and p.share_prompts:
        row = cfg.data.max_prompt_len + cfg.algo.group_size * cfg.rollout.sampling.max_new_tokens
    fit = fit_micro_batch_tokens(arch, row, available, **kw)
    tokens = p.max_tokens_per_micro_batch
    if tokens is None:
        tokens = min(fit, p.max_auto_micro_batch_tokens) // 64 * 64
        if tokens < cfg.max_seq_len:
            need = actor_memory(arch, cfg.max_seq_len, row, **kw)
            raise ConfigError(
                f"parallel.max_tokens_per_micro_batch: not even one sequence of {cfg.max_seq_len} tokens fits: "
                f"predicted peak {need.total / GiB:.1f} GiB ({need.explain()}) > {available / GiB:.1f} GiB {where}"
            )
        how = "chosen"
    else:
        peak = actor_memory(arch, tokens, row, **kw)
        if peak.total > available:
            raise ConfigError(
                f"parallel.max_tokens_per_micro_batch = {tokens}: predicted peak {peak.total / GiB:.1f} GiB "
                f"({peak.explain()}) > {available / GiB:.1f} GiB {where}; at most {fit} tokens fit "
                "(or unset it to choose automatically)"
            )
        how = "set"
    peak = actor_memory(arch, tokens, row, **kw)
    return tokens, (
        f"actor: micro-batch budget {tokens} tokens ({how}; predicted peak {peak.total / GiB:.1f} GiB of "
        f"{available / GiB:.1f} GiB {where})"
    )


def per_position_arrays(seqs: list[Sequence], indices: list[int], offsets: list[int], total: int) -> dict:
    """Flat [total] arrays of a micro-batch whose sequence j starts at ``offsets[j]``: position t carries the label
    t+1 of its sequence and, where that label is a response token (``valid``), its sequence index, response offset,
    old and rollout logprobs, advantage and loss mask. Padding positions are never valid: they reach neither the loss
    nor its token denominator."""
    labels = torch.zeros(total, dtype=torch.long)
    valid = torch.zeros(total, dtype=torch.bool)
    seq_id = torch.full((total,), -1, dtype=torch.long)
    resp_off = torch.zeros(total, dtype=torch.long)
    old, rollout, adv, mask, tis = (torch.zeros(total) for _ in range(5))
    for j, (s, off) in enumerate(zip(seqs, offsets)):
        r, start = s.response_len, off + s.prompt_len - 1  # position `start` predicts the first response token
        span = slice(start, start + r)
        labels[span] = s.tokens[s.prompt_len :]
        valid[span] = True
        seq_id[span] = indices[j]
        resp_off[span] = torch.arange(r)
        old[span] = s.old_logprobs if s.old_logprobs is not None else 0.0
        rollout[span] = s.rollout_logprobs if s.rollout_logprobs is not None else 0.0
        adv[span] = float(s.advantage)
        mask[span] = s.loss_mask.float() if s.loss_mask is not None else 1.0
        tis[span] = s.tis_mask.float() if s.tis_mask is not None else 0.0
    return {
        "labels": labels,
        "valid": valid,
        "seq_id": seq_id,
        "resp_off": resp_off,
        "old_logprobs": old,
        "rollout_logprobs": rollout,
        "advantages": adv,
        "loss_mask": mask,
        "tis_mask": tis,
    }
