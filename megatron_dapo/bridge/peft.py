"""LoRA adapters in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors`` in HF module names, so
``peft.PeftModel.from_pretrained(hf_base, folder)`` reproduces the actor (``tests/dist/test_lora_dist.py``)."""

from __future__ import annotations

import torch

from megatron_dapo.bridge.export import export_order, local_parameters
from megatron_dapo.bridge.reshard import gather_tp
from megatron_dapo.models.registry import table_for


def peft_name(hf_weight: str, which: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
    (PEFT's ``LoraModel`` wraps the causal LM: ``base_model.model.`` + the module path)."""
    return f"base_model.model.{hf_weight.removesuffix('.weight')}.lora_{which}.weight"


def adapter_hf_tensors(model_chunks, arch) -> dict[str, torch.Tensor]:
    """This rank's adapters in HF / PEFT names, whole over TP (a collective of the TP group): a fused layer's adapter
    becomes one per HF module, as the bridge splits the base weight: B's rows (QKV by KV group, gate / up) go where
    the base weight's rows go, and each part keeps the shared A (``q_proj``, ``k_proj``, ``v_proj`` read the same
    input). A row-parallel layer's A is gathered over its input columns."""
    group = None
    if _distributed():
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
    plan = {p.megatron: p for p in export_order(arch)}
    local = local_parameters(model_chunks, arch)
    out = {}
    for name in sorted(n for n in local if n.endswith(".lora_B")):
        stem = name.removesuffix(".lora_B")
        p = plan[f"{stem}.weight"]
        a, b = local[f"{stem}.lora_A"].detach(), local[name].detach()
        if p.mapping.tp_dim == 0:  # column-parallel: B split over the output rows
            b = gather_tp(p, b, group)
        else:  # row-parallel: A split over the input columns
            a = gather_tp(p, a, group)
        for hf, part_a, part_b in peft_parts(p, a, b):
            out[peft_name(hf, "A")] = part_a.clone()
            out[peft_name(hf, "B")] = part_b.clone()
    return out


def peft_parts(p, a: torch.Tensor, b: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(HF weight name, A, B)`` per HF module of one adapted layer, from its whole A and B: a fused layer's B rows go
    where the bridge puts the weight's rows, each part with the shared A."""
    return [(hf, a, part) for hf, part in zip(p.hf, p.to_hf(b))]


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def adapted_params(arch, targets) -> list:
    """The weights LoRA adapts: the ``targets`` layers' weights (a bias is no module), experts excluded
    (``actor/lora.apply_lora``)."""
    return [
        p
        for p in table_for(arch).params(arch)
        if p.megatron.endswith(".weight") and p.megatron.rsplit(".", 2)[-2] in targets and ".experts." not in p.megatron
    ]  # fmt: skip


def peft_config(arch, lora, base_model: str | None = None) -> dict:
    """PEFT's ``adapter_config.json`` for these adapters (``LoraConfig`` fields)."""
    modules = sorted({hf.removesuffix(".weight").rsplit(".", 1)[-1] for p in adapted_params(arch, lora.targets)
                      for hf in p.hf})  # fmt: skip
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "init_lora_weights": True,
    }


def gathered_adapter(model_chunks, arch) -> dict[str, torch.Tensor] | None:
    """Every adapter tensor in PEFT names, on global rank 0 (None elsewhere). Collective: every rank calls it (TP
    gathers, then one gather of each stage's adapters to rank 0: they are megabytes, not the model)."""
    mine = adapter_hf_tensors(model_chunks, arch)
    if not _distributed():
        return mine
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    got = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object({k: v.cpu() for k, v in mine.items()} if first else {}, got, dst=0)
    if dist.get_rank() != 0:
        return None
    return {k: v for part in got for k, v in part.items()}


def write_peft_folder(tensors: dict[str, torch.Tensor], config: dict, out) -> None:
    """``adapter_model.safetensors`` + ``adapter_config.json`` in ``out`` (created)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")


def save_peft_adapter(model_chunks, arch, lora, out, base_model: str | None = None) -> None:
    """The adapters as a PEFT adapter folder (``PeftModel.from_pretrained(base, out)`` loads it), written by global
    rank 0. Collective: every rank calls it."""
    tensors = gathered_adapter(model_chunks, arch)
    if tensors is not None:
        write_peft_folder(tensors, peft_config(arch, lora, base_model), out)
