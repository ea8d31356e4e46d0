"""Load an HF checkpoint straight into a live, sharded megatron model (``model.hf_init``): each rank reads only the
tensors of its pipeline stage and keeps only its tensor-parallel shard. And ``load_checkpoint``: a megatron-dapo
checkpoint, with its frozen base first when it holds a LoRA run's adapters alone."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_dapo.bridge.convert import hf_weight_files, read_st_header, read_st_tensor
from megatron_dapo.bridge.reshard import local_name, split_tp, stage_params
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import ArchConfig
from megatron_dapo.models.hf_config import check_hf_dir
from megatron_dapo.models.mapping import Param


def load_hf_into_model(model_chunks, arch: ArchConfig, hf_dir: str | Path, te: bool = False) -> int:
    """Copy the HF weights into this rank's parameters; returns the number of parameters loaded."""
    from megatron.core import parallel_state as ps

    hf_dir = Path(hf_dir)
    check_hf_dir(arch, hf_dir)
    entries = {}
    for f in hf_weight_files(hf_dir):
        entries.update(read_st_header(f))
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    model = model_chunks[0].module if hasattr(model_chunks[0], "module") else model_chunks[0]
    own = dict(model.named_parameters())

    def shard(p: Param) -> torch.Tensor:
        missing = [n for n in p.hf if n not in entries]
        if missing:
            raise ConfigError(f"{hf_dir}: tensor {missing[0]} is missing (needed for {p.megatron})")
        return split_tp(p, p.to_megatron([read_st_tensor(entries[n]) for n in p.hf]), tp)[tp_rank]

    loaded = 0
    for p in stage_params(arch, pp, stage, ep, ep_rank):
        name = local_name(p, pp, te, ep)
        target = own[name]
        value = shard(p)
        if tuple(value.shape) != tuple(target.shape):
            raise ConfigError(
                f"{hf_dir}: {p.hf[0]} gives {tuple(value.shape)} for {name}, model has {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(value)
        loaded += 1
    if arch.tie_embeddings and pp > 1 and stage == pp - 1:  # the last stage's copy of the tied embedding
        embed = next(p for p in stage_params(arch, pp, 0) if p.megatron.startswith("embedding."))
        with torch.no_grad():
            own["output_layer.weight"].copy_(shard(embed))
        loaded += 1
    return loaded


def load_base(actor, base: dict) -> None:
    """Load a LoRA run's frozen base into ``actor``'s model: ``{"hf_init": dir}`` or ``{"load": checkpoint}``."""
    if "hf_init" in base:
        load_hf_into_model(actor.model, actor.arch, base["hf_init"], te=getattr(actor, "te", False))
    else:
        load_checkpoint(actor, base["load"], load_optimizer=False)


def load_checkpoint(actor, path, load_optimizer: bool = True, base: dict | None = None) -> dict:
    """``actor.load``, with the frozen base loaded first when the checkpoint holds a LoRA run's adapters alone: from
    ``base`` when given (the run's config: where the base is now), else from where the checkpoint says it was. The
    base is then checked against the checkpoint's fingerprint (``actor/checkpoint.check_base``)."""
    from megatron_dapo.actor import checkpoint as ckpt

    meta = ckpt.check_arch(path, actor.arch)
    adapters_only = meta.get("weights") == "adapters"
    if adapters_only:
        source = base or meta["base"]
        ckpt.base_location(source, path)
        actor._base_fingerprint = None  # a new base: fingerprinted once loaded
        load_base(actor, source)
    return ckpt.load(actor, path, load_optimizer=load_optimizer, base_loaded=adapters_only)
