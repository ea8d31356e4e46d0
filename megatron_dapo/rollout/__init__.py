"""Rollout engines (HF transformers on CPU, SGLang on GPU) and the verified weight sync.

from megatron_dapo.rollout import HFEngine, SamplingParams, make_weight_sync
"""

from __future__ import annotations

import importlib

from megatron_dapo.rollout.engine import (
    LogprobGapError,
    RolloutEngine,
    RolloutError,
    Sample,
    SamplingParams,
    TokenizerInfo,
    WeightSyncError,
    check_logprob_gap,
    group_samples,
    logprob_gap,
)

_LAZY = {
    "HFEngine": "megatron_dapo.rollout.hf_engine",
    "SGLangEngine": "megatron_dapo.rollout.sglang_engine",
    "SGLangServer": "megatron_dapo.rollout.sglang_server",
    "WeightSync": "megatron_dapo.rollout.weight_sync",
    "SyncReport": "megatron_dapo.rollout.weight_sync",
    "make_weight_sync": "megatron_dapo.rollout.driver",
}

__all__ = [
    "LogprobGapError",
    "RolloutEngine",
    "RolloutError",
    "Sample",
    "SamplingParams",
    "TokenizerInfo",
    "WeightSyncError",
    "check_logprob_gap",
    "group_samples",
    "logprob_gap",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
