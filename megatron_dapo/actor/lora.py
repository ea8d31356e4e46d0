"""LoRA on megatron-core's linear layers: the base frozen, a low-rank update trained, correct under TP, PP and SP.

    adapted = apply_lora(chunks, cfg.model.lora, sequence_parallel=False, seed=1234)   # before DDP wraps the chunks

Each targeted layer keeps its module and its names (``...linear_qkv.weight`` is still the base weight, so the bridge,
checkpoints and the weight sync see the names they know) and gains two parameters, ``lora_A`` ([r, in]) and ``lora_B``
([out, r], zero at the start, so the adapted model starts as the base), its output becoming
``base(x) + (alpha / r) · B A dropout(x)``. megatron-core splits the two kinds of layer differently over TP
(``tensor_parallel/layers.py``), and so do the adapters:

- **column-parallel** (``linear_qkv``, ``linear_fc1``: the output split): A is whole on every TP rank, B holds this
  rank's rows of the output (the fused QKV / gate-up layout of the base weight's rows, whatever it is). ``A x`` is
  the same on every rank; it goes to B through ``copy_to_tensor_model_parallel_region`` (its gradient all-reduced, so
  A's gradient is whole and equal on every rank). Under sequence parallelism ``A x`` is taken on this rank's sequence
  chunk and gathered (``gather_from_sequence_parallel_region``); A's gradient, a sum over chunks, is then all-reduced
  by ``finalize_model_grads`` (its ``sequence_parallel`` attribute, as for the norms' weights).
- **row-parallel** (``linear_proj``, ``linear_fc2``: the input split): A holds this rank's columns of the input, B is
  whole. ``A_local x_local`` is a partial sum, all-reduced (``reduce_from_tensor_model_parallel_region``; under
  sequence parallelism reduce-scattered to this rank's chunk, and B's gradient all-reduced by the same attribute).

So the merged weight is shard-local: ``W_local + s · B_local A`` (column), ``W_local + s · B A_local`` (row)
(``bridge/lora.py`` merges what the bridge exports). The split params carry megatron's ``tensor_model_parallel``
attributes (gradient clipping counts each once). Experts of a mixture are not adapted (yet).
"""

from __future__ import annotations

import hashlib
import math
import types
from typing import Any

import torch
import torch.nn.functional as F

COLUMN = ("linear_qkv", "linear_fc1")  # output split over TP
ROW = ("linear_proj", "linear_fc2")  # input split over TP
TARGETS = COLUMN + ROW


def _generator(seed: int, name: str) -> torch.Generator:
    """The same numbers for a layer on every rank (A is initialized whole, then sliced): TP-invariant."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def attach(module: torch.nn.Module, kind: str, name: str, lora: Any, sequence_parallel: bool, seed: int) -> None:
    """Adds ``lora_A``/``lora_B`` to one megatron linear layer (``kind``: "column" or "row") and wraps its forward."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    weight = module.weight
    out_local, in_local = weight.shape
    tp_rank, tp = _tp()
    r = lora.rank
    full_in = in_local * tp if kind == "row" else in_local
    a = torch.empty(r, full_in)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=_generator(seed, name))  # as PEFT's default
    if kind == "row":
        a = a[:, tp_rank * in_local : (tp_rank + 1) * in_local]
    b_rows = out_local  # column: this rank's rows; row: the whole output (not split)
    module.lora_A = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
    b = torch.zeros(b_rows, r)
    if getattr(lora, "init", "peft") == "random":  # PEFT's init_lora_weights=False: B random too (tests)
        full_out = out_local * tp if kind == "column" else out_local
        b = torch.randn(full_out, r, generator=_generator(seed, f"{name}:B")) * 0.02
        b = b[tp_rank * out_local : (tp_rank + 1) * out_local] if kind == "column" else b
    module.lora_B = torch.nn.Parameter(b.to(device=weight.device, dtype=weight.dtype).contiguous())
    split = module.lora_B if kind == "column" else module.lora_A
    set_tensor_model_parallel_attributes(split, is_parallel=True, dim=0 if kind == "column" else 1, stride=1)
    whole = module.lora_A if kind == "column" else module.lora_B
    whole.sequence_parallel = sequence_parallel  # its gradient is a sum over sequence chunks: all-reduced over TP
    module.lora_scale = module.lora_B.lora_scale = lora.alpha / r  # (on B too: the bridge's merge reads it there)
    module.lora_kind = kind
    module.lora_dropout = torch.nn.Dropout(lora.dropout) if lora.dropout else torch.nn.Identity()
    base_forward = module.forward

    def forward(self, x, *args, **kwargs):
        out, bias = base_forward(x, *args, **kwargs)
        return out + self.lora_scale * lora_delta(self, x, sequence_parallel), bias

    module.forward = types.MethodType(forward, module)
    base_sharded = module.sharded_state_dict
    # megatron-core MLP.sharded_state_dict (transformer/mlp.py) re-shards a gated fc1's weight by its halves
    gated = name.endswith("linear_fc1") and getattr(module.config, "gated_linear_unit", False)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base's sharded tensors, and the adapters' split as the forward splits them (megatron's own
        ``sharded_state_dict`` would take them as replicated)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = {k: v for k, v in base_sharded(prefix, sharded_offsets, metadata).items() if ".lora_" not in k}
        state = {"lora_A": self.lora_A, "lora_B": self.lora_B}
        axis = {"lora_B": 0} if self.lora_kind == "column" else {"lora_A": 1}
        out.update(make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets))
        if gated:  # B's rows are [gate; up] on each rank: stored as the whole [gate; up], as MLP stores fc1's weight
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            singleton = (metadata or {}).get("singleton_local_shards", False)
            key = f"{prefix}lora_B"
            out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
        return out

    module.sharded_state_dict = types.MethodType(sharded_state_dict, module)


def lora_delta(module: torch.nn.Module, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """``B A dropout(x)`` of one adapted layer, with the TP communication its kind needs (the module docstring)."""
    from megatron.core.tensor_parallel import mappings

    h = F.linear(module.lora_dropout(x), module.lora_A)
    if module.lora_kind == "column":
        h = mappings.gather_from_sequence_parallel_region(h) if sequence_parallel else (
            mappings.copy_to_tensor_model_parallel_region(h))  # fmt: skip
    else:
        h = mappings.reduce_scatter_to_sequence_parallel_region(h) if sequence_parallel else (
            mappings.reduce_from_tensor_model_parallel_region(h))  # fmt: skip
    return F.linear(h, module.lora_B)


def apply_lora(chunks: list[torch.nn.Module], lora: Any, sequence_parallel: bool, seed: int) -> list[str]:
    """Adapts the ``lora.targets`` layers of every chunk and freezes everything else; returns the adapted names."""
    unknown = set(lora.targets) - set(TARGETS)
    if unknown:
        raise ValueError(f"model.lora.targets: {sorted(unknown)} are not LoRA targets (these are: {list(TARGETS)})")
    adapted = []
    for chunk in chunks:
        layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
        for layer in layers:
            for name, module in layer.named_modules():
                leaf = name.rsplit(".", 1)[-1]
                if leaf in lora.targets and ".experts." not in f".{name}." and hasattr(module, "weight"):
                    full = f"decoder.layers.{layer.layer_number - 1}.{name}"  # the global layer: TP/PP-invariant init
                    attach(module, "column" if leaf in COLUMN else "row", full, lora, sequence_parallel, seed)
                    adapted.append(full)
        for pname, p in chunk.named_parameters():
            p.requires_grad = ".lora_" in pname
    if not adapted:
        raise ValueError(f"model.lora.targets {list(lora.targets)}: no such layer in the model")
    return adapted


def lora_parameters(chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The adapters of this rank, by parameter name."""
    return {n: p for c in chunks for n, p in c.named_parameters() if ".lora_" in n}
