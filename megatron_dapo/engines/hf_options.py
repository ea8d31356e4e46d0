"""The in-process HF engine's config block, ``rollout.hf:`` (config-level: ``config/run_config.py`` adds it to
``RolloutConfig`` through ``engines/registry.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class HFOptions:
    max_batch: int = 64  # sequences per generate call, whole groups; also the abort granularity


MOVED_KEYS = {"rollout.hf_max_batch": "rollout.hf.max_batch"}  # before the block (2026-12)


def validate(cfg: Any, fail: Callable[[str, Any, str], None]) -> None:
    if cfg.rollout.hf.max_batch < 1:
        fail("rollout.hf.max_batch", cfg.rollout.hf.max_batch, "must be >= 1")
