"""``dapo convert`` for LoRA: the adapters in a megatron-dapo checkpoint, and PEFT adapter folders.

The actor stores each adapted layer's ``lora_A`` / ``lora_B`` beside its weight (``actor/lora.py``), under the weight's
key with ``weight`` replaced, stacked over layers as the weight is, and a gated ``linear_fc1``'s B as ``[gate; up]``
rows as megatron stores that weight. Whole (global) tensors, the merged weight is ``W + (alpha / r) · B A`` for either
kind of layer, and the bridge's row layout of the weight (``Param.to_hf``: QKV by KV group, gate / up) applies to B's
rows alike: each HF module gets its rows of B and the layer's shared A.

- Megatron → HF (``bridge/convert.py`` calls ``lora_layout``, ``load_adapters``, ``merged``, ``peft_tensors``): the
  merged model, and the adapters alone as a PEFT folder; a checkpoint holding the adapters alone takes its base from
  where the checkpoint names it.
- HF + PEFT → Megatron (``peft_to_megatron``): a PEFT adapter on an HF base becomes a checkpoint holding the adapters
  alone, which the actor loads on that base (``model.load``) and trains on.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from megatron_dapo.actor.lora import TARGETS
from megatron_dapo.bridge.peft import adapted_params, peft_config, peft_name, peft_parts
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import ArchConfig
from megatron_dapo.models.mapping import Param, checkpoint_axes
from megatron_dapo.models.registry import table_for

Entry = tuple[str, tuple, tuple, torch.dtype]  # checkpoint key, leading (index, count) axes, stored shape, dtype


def _adapter_key(p: Param, which: str) -> tuple[str, tuple]:
    key, axes = checkpoint_axes(p)
    return f"{key.removesuffix('weight')}lora_{which}", axes


def lora_layout(shapes: dict, dtypes: dict, arch: ArchConfig, lora: dict, where) -> dict[str, dict[str, Entry]]:
    """Every adapted weight's ``{"A": entry, "B": entry}`` in a checkpoint's tensor metadata; an error names the first
    adapter the checkpoint's ``lora`` settings promise and it lacks."""
    out = {}
    for p in adapted_params(arch, lora["targets"]):
        entries = {}
        for which in ("A", "B"):
            key, axes = _adapter_key(p, which)
            if key not in shapes:
                raise ConfigError(f"{where}: LoRA tensor {key} is missing (dapo_meta.json lora targets "
                                  f"{lora['targets']})")  # fmt: skip
            entries[which] = (key, axes, shapes[key], dtypes[key])
        out[p.megatron] = entries
    return out


def load_adapters(ckpt_dir: Path, params: list[Param], layout: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``(A, B)`` whole, for each of ``params`` that is adapted."""
    from megatron_dapo.bridge.convert import load_entries

    wanted = {f"{p.megatron}#{w}": layout[p.megatron][w] for p in params if p.megatron in layout for w in ("A", "B")}
    got = load_entries(ckpt_dir, wanted) if wanted else {}
    return {p.megatron: (got[f"{p.megatron}#A"], got[f"{p.megatron}#B"]) for p in params if p.megatron in layout}


def merged(p: Param, hf_tensors: list[torch.Tensor], a: torch.Tensor, b: torch.Tensor, scale: float):
    """The HF tensors of ``W + scale · B A`` (computed in fp32, stored in the weight's dtype)."""
    return [(t.float() + scale * (part.float() @ a.float())).to(t.dtype) for t, part in zip(hf_tensors, p.to_hf(b))]


def peft_tensors(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], params: dict[str, Param]) -> dict:
    """The adapters in PEFT names (``bridge/peft.peft_parts``: one per HF module, the fused layers split)."""
    out = {}
    for name, (a, b) in adapters.items():
        for hf, part_a, part_b in peft_parts(params[name], a, b):
            out[peft_name(hf, "A")], out[peft_name(hf, "B")] = part_a.clone(), part_b.clone()  # no shared storage
    return out


# ----------------------------------------------------------------------------------------------------------------------
# PEFT → Megatron


def _targets_of(arch: ArchConfig, modules: list[str], where: Path) -> list[str]:
    """PEFT's ``target_modules`` (HF module names) as our targets; a fused layer needs all of its HF modules."""
    by_target: dict[str, set[str]] = {}
    for p in adapted_params(arch, TARGETS):
        mods = {hf.removesuffix(".weight").rsplit(".", 1)[-1] for hf in p.hf}
        by_target.setdefault(p.megatron.rsplit(".", 2)[-2], set()).update(mods)
    wanted, targets = set(modules), []
    for target, mods in by_target.items():
        if mods <= wanted:
            targets.append(target)
        elif mods & wanted:
            raise ConfigError(f"{where}/adapter_config.json: target_modules {sorted(wanted)} adapt "
                              f"{sorted(mods & wanted)} but not {sorted(mods - wanted)}: megatron fuses them into one "
                              f"{target}, which takes an adapter for all of them or none")  # fmt: skip
    unknown = wanted - set().union(*by_target.values())
    if unknown or not targets:
        raise ConfigError(f"{where}/adapter_config.json: target_modules {sorted(unknown or wanted)} are not layers "
                          f"LoRA adapts here ({sorted(set().union(*by_target.values()))})")  # fmt: skip
    return targets


def read_peft(adapter_dir: Path, arch: ArchConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """PEFT's ``adapter_config.json`` as our ``lora`` settings, and its tensors; errors name the first unsupported
    setting."""
    from safetensors.torch import load_file

    cfg_file, weights = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    for f in (cfg_file, weights):
        if not f.is_file():
            raise ConfigError(f"{f}: no such file (a PEFT adapter folder holds adapter_config.json and "
                              "adapter_model.safetensors)")  # fmt: skip
    cfg = json.loads(cfg_file.read_text())
    for key, ok in (("peft_type", "LORA"), ("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False)):
        if cfg.get(key, ok) != ok:
            raise ConfigError(f"{cfg_file}: {key} = {cfg[key]!r}; only {ok!r} converts")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ConfigError(f"{cfg_file}: rank_pattern / alpha_pattern: one rank and alpha for every layer only")
    modules = cfg["target_modules"]
    modules = [modules] if isinstance(modules, str) else list(modules)
    lora = {"rank": int(cfg["r"]), "alpha": float(cfg["lora_alpha"]), "dropout": float(cfg.get("lora_dropout", 0.0)),
            "targets": _targets_of(arch, modules, adapter_dir)}  # fmt: skip
    return lora, load_file(str(weights))


def megatron_adapters(arch: ArchConfig, lora: dict, tensors: dict[str, torch.Tensor], where: Path) -> dict:
    """``{megatron weight name: (A, B)}`` from PEFT tensors: B's parts joined in the weight's row layout
    (``Param.to_megatron``); the parts of a fused layer must share one A."""
    out = {}
    for p in adapted_params(arch, lora["targets"]):
        parts_a, parts_b = [], []
        for hf in p.hf:
            for which, parts in (("A", parts_a), ("B", parts_b)):
                name = peft_name(hf, which)
                if name not in tensors:
                    raise ConfigError(f"{where}/adapter_model.safetensors: {name} is missing")
                parts.append(tensors[name])
        for hf, a in zip(p.hf[1:], parts_a[1:]):
            if not torch.equal(a, parts_a[0]):
                raise ConfigError(f"{where}: {peft_name(hf, 'A')} differs from {peft_name(p.hf[0], 'A')}: megatron's "
                                  f"fused {p.megatron} shares one A among {len(p.hf)} HF modules")  # fmt: skip
        b = p.to_megatron(parts_b) if len(parts_b) > 1 else parts_b[0]
        want = (lora["rank"], p.shape()[1]), (p.shape()[0], lora["rank"])
        if (tuple(parts_a[0].shape), tuple(b.shape)) != want:
            raise ConfigError(f"{where}: the adapter of {p.hf[0]} has shapes {tuple(parts_a[0].shape)} / "
                              f"{tuple(b.shape)}, rank {lora['rank']} on this model needs {want[0]} / {want[1]}")  # fmt: skip
        out[p.megatron] = (parts_a[0], b)
    return out


def save_adapters(out: Path, arch: ArchConfig, adapters: dict, dtype: torch.dtype) -> None:
    """The adapters as a megatron-core dist checkpoint under the keys the actor's LoRA layers use."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    params = {p.megatron: p for p in table_for(arch).params(arch)}
    sharded = {}
    for name, (a, b) in adapters.items():
        for which, t in (("A", a), ("B", b)):
            key, axes = _adapter_key(params[name], which)
            data = t.to(dtype).contiguous().reshape((1,) * len(axes) + tuple(t.shape))
            offsets = [(i, index, count) for i, (index, count) in enumerate(axes)]
            sharded[f"{name}#{which}"] = ShardedTensor.from_rank_offsets(key, data, *offsets, replica_id=0)
    dist_checkpointing.save({"model": sharded}, str(out), validate_access_integrity=False)


def peft_to_megatron(hf_dir, adapter_dir, out_dir, dtype: str | None = None, overwrite: bool = False) -> ArchConfig:
    """A PEFT adapter on the HF base ``hf_dir`` → a megatron-dapo checkpoint holding the adapters alone, its base named
    as ``{"hf_init": hf_dir}`` (``model.load`` of it loads the base from there, then the adapters)."""
    from megatron_dapo.actor.checkpoint import use_forked_results_queue
    from megatron_dapo.bridge.convert import (
        DTYPES,
        _hf_dtype,
        check_output_dir,
        plan_hf_to_megatron,
        single_process_group,
        staged_output,
        write_meta,
    )  # fmt: skip

    hf_dir, adapter_dir, out = Path(hf_dir), Path(adapter_dir), Path(out_dir)
    arch, entries, _ = plan_hf_to_megatron(hf_dir)
    lora, tensors = read_peft(adapter_dir, arch)
    adapters = megatron_adapters(arch, lora, tensors, adapter_dir)
    dtype = dtype or _hf_dtype(hf_dir, entries)
    check_output_dir(out, overwrite)
    with staged_output(out) as tmp, single_process_group():
        use_forked_results_queue()
        save_adapters(tmp, arch, adapters, DTYPES[dtype])
        base = {"hf_init": str(hf_dir.resolve())}
        write_meta(tmp, arch, dtype, kind="model", weights="adapters", base=base, lora=lora,
                   source=str(adapter_dir.resolve()))  # fmt: skip
    return arch


def peft_folder_config(arch: ArchConfig, lora: dict, base: str | None) -> dict:
    """``peft_config`` for a checkpoint's ``lora`` settings (``dapo_meta.json``)."""
    settings = SimpleNamespace(rank=lora["rank"], alpha=lora["alpha"], dropout=lora.get("dropout", 0.0),
                               targets=lora["targets"])  # fmt: skip
    return peft_config(arch, settings, base)
