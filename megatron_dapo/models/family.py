"""What megatron-dapo knows of one model family. Each family's file in ``models/`` declares one ``Family`` (``FAMILY``)
and ``models/registry.py`` lists them; the rest of the package reads these fields, never a family's name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_dapo.models.mapping import MappingTable


@dataclass(frozen=True)
class Family:
    name: str  # a model config's ``family:`` (ArchConfig.family)
    hf_architectures: tuple[str, ...]  # config.json ``architectures`` that select it
    hf_model_type: str  # config.json ``model_type``
    table: MappingTable  # HF ⇄ Megatron parameter names, layouts and TP splits
    qkv_bias: bool | str = False  # True: always; a config.json key: that flag (read, and written back)
    qk_layernorm: bool = False  # per-head RMSNorm on q and k (HF config.json has no switch for it)
    hf_fixed: dict[str, object] = field(default_factory=dict)  # config.json fields fixed for the family (written)
    moe: bool = False  # a mixture of experts (ArchConfig.num_experts > 0)
    # ArchConfig fields the family reads from config.json beyond the shared ones (hf_config.FIELDS), and writes back
    extra_from_hf: Callable[[dict, str], dict] | None = None
    extra_to_hf: Callable[..., dict] | None = None
