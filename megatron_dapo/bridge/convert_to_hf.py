"""Megatron → HF (``megatron_to_hf``): layers are loaded a bucket at a time and written into safetensors shards of at
most ``max_shard_size``, with ``model.safetensors.index.json``, ``config.json`` and the template's tokenizer files; a
LoRA run's checkpoint as the merged model and a PEFT folder (``convert_lora.py``). The shared pieces (metadata,
safetensors reads, staged output) are in ``convert.py``, whose docstring describes both directions."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from megatron_dapo.actor.checkpoint import META_FILE, base_location
from megatron_dapo.bridge.convert import (
    DTYPE_NAMES,
    DTYPES,
    TEMPLATE_FILES,
    _check_tensors,
    _progress,
    _ShardWriter,
    check_output_dir,
    load_entries,
    parse_size,
    plan_hf_to_megatron,
    read_meta,
    read_st_tensor,
    single_process_group,
    staged_output,
    tensors_metadata,
)  # fmt: skip
from megatron_dapo.bridge.convert_lora import load_adapters, lora_layout, merged, peft_folder_config, peft_tensors
from megatron_dapo.bridge.peft import write_peft_folder
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import ArchConfig, compare_arch
from megatron_dapo.models.hf_config import arch_from_hf, hf_from_arch, read_hf_config
from megatron_dapo.models.mapping import Param, checkpoint_axes
from megatron_dapo.models.registry import table_for

# ----------------------------------------------------------------------------------------------------------------------
# Megatron → HF


def _ckpt_layout(ckpt_dir: Path, arch: ArchConfig) -> dict[str, tuple]:
    """For every parameter: (checkpoint key, its (index, count) on the leading axes, stored shape, dtype).

    Accepts the actor's canonical keys and megatron-core's own (TE-spelled) keys, stacked or one key per layer;
    raises one error listing missing / unexpected / wrongly shaped model tensors. LoRA adapters are not parameters of
    the HF model: ``convert_lora.lora_layout`` reads them.
    """
    shapes, dtypes = tensors_metadata(ckpt_dir)
    layout, present, expected = {}, {}, {}
    for p in table_for(arch).params(arch):
        want = p.shape()
        expected[p.megatron] = want
        found = None
        for te in (False, True):
            key, axes = checkpoint_axes(p, te)
            if key in shapes:
                stored = shapes[key]
                counts = tuple(count for _, count in axes)
                if stored[: len(axes)] != counts:
                    what = "layers" if not p.arch.is_moe else "experts"
                    raise ConfigError(f"{ckpt_dir}: {key}: {stored[0]} {what} stored, model has {counts[0]}")
                found = (key, axes, stored[len(axes) :])
            elif axes and not p.arch.is_moe:  # a dense model saved one key per layer
                key = key.replace("layers.", f"layers.{p.layer}.", 1)
                if key in shapes:
                    found = (key, (), shapes[key])
            if found:
                break
        if found is None:
            continue
        key, axes, got = found
        if p.mapping.vocab and len(got) == len(want) and got[0] >= arch.vocab_size and got[1:] == want[1:]:
            got = want  # vocabulary rows padded for TP: stripped on conversion
        present[p.megatron] = got
        layout[p.megatron] = (key, axes, shapes[key], dtypes[key])
    model_keys = re.compile(r"^(embedding|decoder|output_layer)\.")
    known = {v[0] for v in layout.values()}
    stray = [k for k in shapes if model_keys.match(k) and k not in known and not k.endswith("_extra_state")
             and ".lora_" not in k]  # fmt: skip
    if arch.tie_embeddings:
        stray = [k for k in stray if k != "output_layer.weight"]
    present.update({k: shapes[k] for k in stray})
    _check_tensors(str(ckpt_dir), present, expected, lambda n: False)
    return layout


def _load_params(ckpt_dir: Path, params: list[Param], layout: dict) -> dict[str, torch.Tensor]:
    return load_entries(ckpt_dir, {p.megatron: layout[p.megatron] for p in params})


def megatron_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    hf_template: str | Path | None = None,
    overwrite: bool = False,
    max_shard_size: str | int = "2GB",
    bucket_bytes: int = 512 << 20,
    progress: bool = False,
    adapter_out: str | Path | None = None,
) -> ArchConfig:
    """Convert a megatron-dapo checkpoint (converted or saved by the actor) into an HF directory transformers loads.

    A LoRA run's checkpoint becomes the merged model (``W + (alpha / r) · B A``), and its adapters alone a PEFT folder
    (``adapter_out``, default ``<out>_adapter``); one holding the adapters alone reads its base where it names it."""
    ckpt_dir, out = Path(ckpt_dir), Path(out_dir)
    if not ckpt_dir.is_dir():
        raise ConfigError(f"{ckpt_dir}: checkpoint directory does not exist")
    template_cfg = None
    if hf_template is not None:
        template_cfg = read_hf_config(Path(hf_template))
    if (ckpt_dir / META_FILE).is_file() or template_cfg is None:
        arch, meta = read_meta(ckpt_dir)
        if template_cfg is not None:
            compare_arch(
                arch, arch_from_hf(template_cfg, source=f"{hf_template}/config.json"), f"{hf_template}/config.json"
            )
    else:
        arch, meta = arch_from_hf(template_cfg, source=f"{hf_template}/config.json"), {}
    lora = meta.get("lora")
    base_ckpt, base_hf = ckpt_dir, None
    if meta.get("weights") == "adapters":  # the frozen base is elsewhere: where the checkpoint says
        where = base_location(meta["base"], ckpt_dir)
        base_ckpt, base_hf = (where, None) if "load" in meta["base"] else (None, where)
    max_bytes = parse_size(max_shard_size)
    check_output_dir(out, overwrite)
    if lora:
        adapter_out = Path(adapter_out or f"{out}_adapter")
        check_output_dir(adapter_out, overwrite)
    table = table_for(arch)
    params = table.params(arch)
    with single_process_group():
        if base_hf is None:
            layout = _ckpt_layout(base_ckpt, arch)
            dtype = next(iter(layout.values()))[3]
        else:
            _, entries, _ = plan_hf_to_megatron(base_hf, arch)
            dtype = DTYPES[meta["dtype"]]
        adapters = lora_layout(*tensors_metadata(ckpt_dir), arch, lora, ckpt_dir) if lora else {}
    dtype_name = meta.get("dtype") or DTYPE_NAMES.get(dtype, "fp32")
    buckets, cur, size = [], [], 0
    for p in params:
        nbytes = int(torch.Size(p.shape()).numel()) * torch.empty((), dtype=dtype).element_size()
        if cur and size + nbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += nbytes
    buckets.append(cur)
    trained = {}  # the adapters (megabytes): the PEFT folder is written after the model
    with staged_output(out) as tmp, single_process_group(), _progress(progress) as bar:
        task = bar.add_task("Megatron → HF", total=len(params))
        plan = [(h, tuple(s), dtype) for p in params for h, s in zip(p.hf, p.hf_shapes())]
        writer = _ShardWriter(tmp, plan, max_bytes)
        for bucket in buckets:
            full = _load_params(base_ckpt, bucket, layout) if base_hf is None else None
            pairs = load_adapters(ckpt_dir, bucket, adapters)
            for p in bucket:
                if full is not None:
                    tensors = p.to_hf(full.pop(p.megatron))
                else:
                    tensors = [read_st_tensor(entries[name]).to(dtype) for name in p.hf]
                if p.megatron in pairs:
                    tensors = merged(p, tensors, *pairs[p.megatron], lora["alpha"] / lora["rank"])
                    trained[p.megatron] = pairs[p.megatron]
                for name, t in zip(p.hf, tensors):
                    writer.add(name, t)
                bar.advance(task)
        writer.close()
        cfg = dict(template_cfg) if template_cfg is not None else {}
        cfg.update(hf_from_arch(arch, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype_name]))
        if "dtype" in cfg:  # transformers >= 5 writes "dtype"; keep the two spellings consistent
            cfg["dtype"] = cfg["torch_dtype"]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if hf_template is not None:
            for f in sorted(Path(hf_template).iterdir()):
                if f.is_file() and TEMPLATE_FILES.match(f.name):
                    shutil.copy2(f, tmp / f.name)
    if lora:
        with staged_output(adapter_out) as tmp:
            tensors = peft_tensors(trained, {p.megatron: p for p in params})
            base = str(base_hf) if base_hf is not None else None
            write_peft_folder(tensors, peft_folder_config(arch, lora, base), tmp)
    return arch
