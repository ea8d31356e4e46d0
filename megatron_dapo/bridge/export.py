"""HF-named full tensors from a live, sharded megatron-core model (the weight sync to the rollout engine).

    for bucket in export_hf_tensors(model_chunks, arch):     # EVERY rank iterates to the end (collectives inside)
        if bucket:                                           # only receiving ranks get tensors
            engine.update_weights(bucket)                    # [(hf_name, full tensor), ...], <= bucket_bytes

Who receives (``dst``):
* ``"rank0"`` (default): the first rank of the model replica (global rank 0) gets every tensor; the TP ranks of each
  stage all-gather over ``parallel_state.get_tensor_model_parallel_group()``, then the stage's TP rank 0 sends the full
  tensors point to point to that rank.
* ``"stage"``: each PP stage's TP rank 0 gets the tensors of its own stage (no PP traffic; e.g. one SGLang sender per
  stage).
* ``"all"``: every rank of every replica gets every tensor (the per-node weight sync, ``rollout/node_sync.py``: the
  ranks that feed an engine on their own node need the whole model; slime's ``hf_weight_iterator_direct.py`` does the
  same): the TP ranks all-gather, then each stage broadcasts its full tensors over the pipeline group.

With ``rank0`` and ``stage`` only data-parallel (and context-parallel) rank 0's replica takes part; the other replicas
hold the same weights and return at once. Vocabulary padding is stripped; a tied lm_head is not sent (the HF model ties it to the embedding);
with tied embeddings and PP > 1 the last stage's copy of the embedding is skipped. A tensor larger than
``bucket_bytes`` forms a bucket of its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron_dapo.bridge.mappings import Param, canonical_name, split_layer, table_for
from megatron_dapo.bridge.reshard import gather_tp
from megatron_dapo.config import ArchConfig

_DTYPE_CODES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):  # DDP, Float16Module
        module = module.module
    return module


def local_parameters(model_chunks, arch: ArchConfig) -> dict[str, torch.Tensor]:
    """This rank's parameter shards by canonical name (global layer index, local-spec spelling)."""
    out = {}
    for chunk in model_chunks:
        chunk = _unwrap(chunk)
        layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
        for name, p in chunk.named_parameters():
            name = canonical_name(name)
            local, rest = split_layer(name)
            if local is not None:
                name = f"decoder.layers.{layers[local].layer_number - 1}.{rest}"
            elif name == "output_layer.weight" and arch.tie_embeddings:
                continue  # the last stage's copy of the tied embedding
            out[name] = p
    return out


def _bucketed(items: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket, size = [], 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def export_hf_tensors(
    model_chunks, arch: ArchConfig, bucket_bytes: int = 512 << 20, dst: str = "rank0"
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of ``(hf_name, full tensor)`` from the live model; see the module docstring for who receives what."""
    if dst not in ("rank0", "stage", "all"):
        raise ValueError(f"dst = {dst!r}: must be 'rank0', 'stage' or 'all'")
    yield from _bucketed(_export_items(model_chunks, arch, dst), bucket_bytes)


def _export_items(model_chunks, arch: ArchConfig, dst: str) -> Iterator[tuple[str, torch.Tensor]]:
    import torch.distributed as dist

    params = table_for(arch).params(arch)
    local = local_parameters(model_chunks, arch)
    if not dist.is_initialized():
        for p in params:
            yield from zip(p.hf, p.to_hf(local[p.megatron].detach()))
        return
    from megatron.core import parallel_state as ps

    if dst == "all":
        yield from _export_to_all(params, local, arch)
        return
    if ps.get_data_parallel_rank(with_context_parallel=True) != 0:
        return
    tp_group = ps.get_tensor_model_parallel_group()
    tp_rank = ps.get_tensor_model_parallel_rank()
    stage = ps.get_pipeline_model_parallel_rank()
    pp = ps.get_pipeline_model_parallel_world_size()
    mine = [p for p in params if p.megatron in local]

    def gathered(p: Param) -> torch.Tensor:
        return gather_tp(p, local[p.megatron], tp_group)

    if dst == "stage" or pp == 1:
        for p in mine:
            full = gathered(p)
            if tp_rank == 0:
                yield from zip(p.hf, p.to_hf(full))
        return

    pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    receiver = pp_ranks[0]
    # Every tensor crossing stages lives on the parameters' device: NCCL takes only CUDA tensors (torch
    # csrc/distributed/c10d/ProcessGroupNCCL.cpp, check_gpu_single_tensor: "Tensors must be CUDA and dense").
    device = next(iter(local.values())).device
    if stage > 0:  # gather; TP rank 0 sends to the replica's first rank
        codes = torch.tensor([_DTYPE_CODES.index(local[p.megatron].dtype) for p in mine], dtype=torch.int64)
        if tp_rank == 0:
            dist.send(torch.tensor([len(mine)], dtype=torch.int64, device=device), receiver)
            dist.send(codes.to(device), receiver)
        for p in mine:
            full = gathered(p)
            if tp_rank == 0:
                dist.send(full.contiguous(), receiver)
        return
    # Stage 0: own parameters first, then every later stage's, in model order.
    for p in mine:
        full = gathered(p)
        if tp_rank == 0:
            yield from zip(p.hf, p.to_hf(full))
    if tp_rank != 0:
        return
    by_name = {p.megatron: p for p in params}
    for s in range(1, pp):
        theirs = [p for p in params if p.megatron not in local and _stage_of(p, arch, pp) == s]
        count = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(count, pp_ranks[s])
        if int(count) != len(theirs):
            raise RuntimeError(f"export: stage {s} sends {int(count)} parameters, expected {len(theirs)}")
        codes = torch.zeros(len(theirs), dtype=torch.int64, device=device)
        dist.recv(codes, pp_ranks[s])
        for p, code in zip(theirs, codes.tolist()):
            buf = torch.empty(by_name[p.megatron].shape(), dtype=_DTYPE_CODES[code], device=device)
            dist.recv(buf, pp_ranks[s])
            yield from zip(p.hf, p.to_hf(buf))


def _export_to_all(params: list[Param], local: dict, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """``dst="all"``: in model order, the owning stage's TP ranks all-gather each parameter and broadcast the full
    tensor over their pipeline group, so every rank yields every tensor."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    stage, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    device = next(iter(local.values())).device  # NCCL takes only CUDA tensors (see the PP path above)
    missing = [p.megatron for p in params if _stage_of(p, arch, pp) == stage and p.megatron not in local]
    flag = torch.tensor([len(missing)], dtype=torch.int64, device=device)
    if pp > 1:  # every stage learns it, so none is left waiting in a broadcast
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pp_group)
    if int(flag):
        raise RuntimeError(f"export: stage {stage} lacks {missing[:3]}: the layer split differs from _stage_of")
    for s in range(pp):
        theirs = [p for p in params if _stage_of(p, arch, pp) == s]
        codes = torch.zeros(len(theirs), dtype=torch.int64, device=device)
        if s == stage:
            codes.copy_(torch.tensor([_DTYPE_CODES.index(local[p.megatron].dtype) for p in theirs]))
        if pp > 1:
            dist.broadcast(codes, pp_ranks[s], group=pp_group)
        for p, code in zip(theirs, codes.tolist()):
            if s == stage:
                full = gather_tp(p, local[p.megatron], tp_group)
            else:
                full = torch.empty(p.shape(), dtype=_DTYPE_CODES[code], device=device)
            if pp > 1:
                full = full.contiguous()
                dist.broadcast(full, pp_ranks[s], group=pp_group)
            yield from zip(p.hf, p.to_hf(full))


def _stage_of(p: Param, arch: ArchConfig, pp: int) -> int:
    if p.layer is not None:
        return p.layer // (arch.num_layers // pp)
    return 0 if p.megatron.startswith("embedding.") else pp - 1


def save_hf_checkpoint(model_chunks, arch: ArchConfig, out, tokenizer=None, bucket_bytes: int = 512 << 20) -> None:
    """Write the live model as an HF checkpoint (model.safetensors + config.json [+ tokenizer]) from global rank 0.

    Collective like ``export_hf_tensors``: every rank calls it. For checkpoints too large for one process's memory use
    ``tools/convert_megatron_to_hf.py`` on a saved checkpoint (it streams shard by shard).
    """
    import json
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import save_file

    from megatron_dapo.bridge.hf_config import hf_from_arch

    tensors = {}
    for bucket in export_hf_tensors(model_chunks, arch, bucket_bytes):
        tensors.update({name: t.contiguous().clone() for name, t in bucket})
    if not dist.is_initialized() or dist.get_rank() == 0:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.") if tensors else "float32"
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(hf_from_arch(arch, dtype), indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
    if dist.is_initialized():
        dist.barrier()
