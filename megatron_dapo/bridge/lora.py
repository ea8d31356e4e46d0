"""LoRA adapters merged into the weights the bridge exports (a full-weight sync, a merged HF checkpoint).

An adapted layer (``actor/lora.py``) holds ``<layer>.weight`` (the frozen base), ``<layer>.lora_A`` and
``<layer>.lora_B`` (its ``lora_scale`` = alpha / r on it). On every rank the merged shard is ``W + s · B @ A``: for a
column-parallel layer B holds this rank's output rows and A is whole; for a row-parallel one A holds this rank's input
columns and B is whole; either way the product is this rank's shard of ``s · B_full @ A_full``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def has_lora(local: Mapping[str, torch.Tensor]) -> bool:
    return any(name.endswith(".lora_B") for name in local)


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    with torch.no_grad():
        delta = (lora_b.float() @ lora_a.float()) * scale
        return (weight.float() + delta).to(weight.dtype)


class MergedParameters(dict):
    """This rank's parameters by name, the adapters merged into their base weights when read (one layer at a time:
    no second copy of the model), the adapters themselves left out."""

    def __init__(self, local: Mapping[str, torch.Tensor]):
        super().__init__((n, t) for n, t in local.items() if ".lora_" not in n)
        self._adapters = {
            n.removesuffix(".lora_B") + ".weight": (local[n.removesuffix("_B") + "_A"], local[n])
            for n in local
            if n.endswith(".lora_B")
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        weight = super().__getitem__(name)
        if name not in self._adapters:
            return weight
        a, b = self._adapters[name]
        return merged_weight(weight, a, b, b.lora_scale)


def merge_lora(local: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``local`` as the bridge reads it: merged where adapted (``MergedParameters``), else unchanged."""
    return MergedParameters(local) if has_lora(local) else local
