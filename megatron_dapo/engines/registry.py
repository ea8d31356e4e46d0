"""The rollout engines, by ``rollout.engine``: what each needs to start and how it is made. Adding an engine is one
subpackage in ``engines/`` (a ``RolloutEngine``, see ``base.py``) and one entry here (docs/extending.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_dapo.config.plugins import load_callable
from megatron_dapo.config.typed_yaml import ConfigError

if TYPE_CHECKING:
    from megatron_dapo.engines.base import RolloutEngine
    from megatron_dapo.models.arch import ArchConfig
    from megatron_dapo.types import TokenizerInfo


@dataclass(frozen=True)
class EngineSpec:
    name: str
    # "package.module:callable" (dotted attributes allowed): (cfg, arch, tokenizer_info, run_dir, model_path) -> engine
    factory: str
    starts_from_hf_dir: bool  # its servers load an HF checkpoint directory (the actor's weights are written first)
    weight_syncs: tuple[str, ...]  # the rollout.weight_sync transports it takes

    def make(self, cfg: Any, arch: ArchConfig, info: TokenizerInfo, run_dir: Path, model_path) -> RolloutEngine:
        return load_callable(self.factory, f"rollout.engine {self.name!r} factory")(
            cfg, arch, info, run_dir, model_path
        )


ENGINES: dict[str, EngineSpec] = {
    "hf": EngineSpec("hf", "megatron_dapo.engines.hf:engine_from_config", False, ("copy",)),
    "sglang": EngineSpec(
        "sglang", "megatron_dapo.engines.sglang.client:engine_from_config", True, ("tensor", "distributed", "disk")
    ),
}


def engine_spec(name: str) -> EngineSpec:
    if name not in ENGINES:
        raise ConfigError(f"rollout.engine = {name!r}: unknown; known: {', '.join(ENGINES)}")
    return ENGINES[name]
