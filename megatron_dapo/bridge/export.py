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
* ``"all"``: every rank of every replica gets every tensor (the per-node weight sync, ``sync/per_node.py``: the
  ranks that feed an engine on their own node need the whole model; slime's ``hf_weight_iterator_direct.py`` does the
  same): the TP ranks all-gather, then each stage broadcasts its full tensors over the pipeline group.

With ``rank0`` and ``stage`` only data-parallel (and context-parallel) rank 0's replica takes part; the other replicas
hold the same weights and return at once. Vocabulary padding is stripped; a tied lm_head is not sent (the HF model ties it to the embedding);
with tied embeddings and PP > 1 the last stage's copy of the embedding is skipped. A tensor larger than
``bucket_bytes`` forms a bucket of its own.

``save_hf_checkpoint`` (the end of a run, the SGLang servers' first weights) streams these buckets from global rank 0
into bounded safetensors shards; ``export_plan`` says, without a model, how many and how much memory it takes.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_dapo.bridge.lora import merge_lora as merged_view
from megatron_dapo.bridge.reshard import gather_tp
from megatron_dapo.models.arch import ArchConfig
from megatron_dapo.models.mapping import Param, canonical_name, split_layer
from megatron_dapo.models.registry import table_for

_DTYPE_CODES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):  # DDP, Float16Module
        module = module.module
    return module


def local_parameters(model_chunks, arch: ArchConfig) -> dict[str, torch.Tensor]:
    """This rank's parameter shards by canonical name (global layer index, global expert index, local-spec
    spelling)."""
    out = {}
    ep_rank, ep = 0, 1
    if arch.is_moe and _distributed():
        from megatron.core import parallel_state as ps

        ep_rank, ep = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    for chunk in model_chunks:
        chunk = _unwrap(chunk)
        layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
        for name, p in chunk.named_parameters():
            name = canonical_name(name)
            local, rest = split_layer(name)
            if local is not None:
                m = _LOCAL_EXPERT.match(rest)
                if m:  # SequentialMLP: global expert = ep_rank · experts / EP + local index
                    rest = f"mlp.experts.{ep_rank * (arch.num_experts // ep) + int(m.group(1))}.{m.group(2)}"
                name = f"decoder.layers.{layers[local].layer_number - 1}.{rest}"
            elif name == "output_layer.weight" and arch.tie_embeddings:
                continue  # the last stage's copy of the tied embedding
            out[name] = p
    return out


_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def _dtype(local: dict, name: str) -> torch.dtype:
    """The dtype of ``local[name]`` without reading it (a LoRA-merged weight would be computed): the stored tensor's."""
    return dict.__getitem__(local, name).dtype


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bucketed(items: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int, size_of=_nbytes) -> Iterator[list]:
    bucket, size = [], 0
    for name, t in items:
        nbytes = size_of(t)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def export_hf_tensors(
    model_chunks, arch: ArchConfig, bucket_bytes: int = 512 << 20, dst: str = "rank0", merge_lora: bool = True
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of ``(hf_name, full tensor)`` from the live model; see the module docstring for who receives what.
    With LoRA the adapted weights, merged (``merge_lora=False``: the frozen base alone, for an engine that applies
    the adapters itself)."""
    if dst not in ("rank0", "stage", "all"):
        raise ValueError(f"dst = {dst!r}: must be 'rank0', 'stage' or 'all'")
    yield from _bucketed(_export_items(model_chunks, arch, dst, merge_lora), bucket_bytes)


def _export_items(model_chunks, arch: ArchConfig, dst: str, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    import torch.distributed as dist

    params = export_order(arch)
    local = local_parameters(model_chunks, arch)  # (the adapters' own tensors are in no HF name: never exported)
    local = merged_view(local) if merge else local  # LoRA: the adapted weights merged, layer by layer
    if not dist.is_initialized():
        for p in params:
            yield from zip(p.hf, p.to_hf(local[p.megatron].detach()))
        return
    yield from _export_dense([p for p in params if p.expert is None], local, arch, dst)
    if arch.is_moe:
        yield from _export_experts([p for p in params if p.expert is not None], local, arch, dst)


def export_order(arch: ArchConfig) -> list[Param]:
    """The order tensors are exported in: model order, the experts (if any) last."""
    params = table_for(arch).params(arch)
    return [p for p in params if p.expert is None] + [p for p in params if p.expert is not None]


def _export_dense(params: list[Param], local: dict, arch: ArchConfig, dst: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter but the experts: data-parallel replica 0 sends, see the module docstring."""
    import torch.distributed as dist
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
        codes = torch.tensor([_DTYPE_CODES.index(_dtype(local, p.megatron)) for p in mine], dtype=torch.int64)
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
        for p, code in zip(theirs, recv_manifest(s, len(theirs), pp_ranks[s], device)):
            buf = torch.empty(by_name[p.megatron].shape(), dtype=_DTYPE_CODES[code], device=device)
            dist.recv(buf, pp_ranks[s])
            yield from zip(p.hf, p.to_hf(buf))


def recv_manifest(stage: int, expected: int, src: int, device) -> list[int]:
    """The dtype codes of the parameters pipeline stage ``stage`` (global rank ``src``) is about to send to stage 0,
    checked against the ``expected`` count."""
    import torch.distributed as dist

    count = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(count, src)
    if int(count) != expected:
        raise RuntimeError(f"export: stage {stage} sends {int(count)} parameters, expected {expected}")
    codes = torch.zeros(expected, dtype=torch.int64, device=device)
    dist.recv(codes, src)
    return codes.tolist()


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
            codes.copy_(torch.tensor([_DTYPE_CODES.index(_dtype(local, p.megatron)) for p in theirs]))
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


def _export_experts(params: list[Param], local: dict, arch: ArchConfig, dst: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The experts, one at a time: the expert-TP ranks of the EP rank that owns an expert (first expert-data-parallel
    replica) gather it, and its expert-TP rank 0 sends it to the receiver of its stage (``rank0``: global rank 0;
    ``stage``: the stage's first rank) or broadcasts it to every rank (``all``). No rank ever holds more than one
    expert it does not own."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_dapo.bridge.reshard import ep_rank_of_expert

    pp = ps.get_pipeline_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    me = expert_coordinates()
    everyone = all_expert_coordinates(me)
    owner = {(s, e): g for g, s, e, etp, edp, _, _ in everyone if etp == 0 and edp == 0}
    first = {s: min(g for g, s2, *_, dp, tp in everyone if s2 == s and dp == 0 and tp == 0) for s in range(pp)}
    receiver = {s: first[0] if dst == "rank0" else first[s] for s in range(pp)}
    rank, edp = me[0], me[4]
    etp_group = ps.get_expert_tensor_parallel_group()
    mine = [t for name, t in local.items() if ".mlp.experts." in name] or list(local.values())
    device, dtype = mine[0].device, mine[0].dtype
    for p in params:
        s = _stage_of(p, arch, pp)
        src = owner[s, ep_rank_of_expert(p.expert, arch, ep)[0]]
        full = None
        if p.megatron in local and edp == 0:
            full = gather_tp(p, local[p.megatron], etp_group)
        if dst == "all":
            buf = full.contiguous() if rank == src else torch.empty(p.shape(), dtype=dtype, device=device)
            dist.broadcast(buf, src)
            yield from zip(p.hf, p.to_hf(buf))
        elif rank == src and src != receiver[s]:
            dist.send(full.contiguous(), receiver[s])
        elif rank == receiver[s]:
            if src != rank:
                full = torch.empty(p.shape(), dtype=dtype, device=device)
                dist.recv(full, src)
            yield from zip(p.hf, p.to_hf(full))


def expert_coordinates() -> tuple[int, ...]:
    """This rank's (global, PP, EP, expert-TP, expert-DP, DP·CP, TP) ranks, from megatron-core's ``parallel_state``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return (
        dist.get_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_tensor_parallel_rank(),
        ps.get_expert_data_parallel_rank(),
        ps.get_data_parallel_rank(with_context_parallel=True),
        ps.get_tensor_model_parallel_rank(),
    )


def all_expert_coordinates(me: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every rank's ``expert_coordinates``, by global rank (an all-gather over the default group)."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    return everyone


def _stage_of(p: Param, arch: ArchConfig, pp: int) -> int:
    if p.layer is not None:
        return p.layer // (arch.num_layers // pp)
    return 0 if p.megatron.startswith("embedding.") else pp - 1


# ----------------------------------------------------------------------------------------------------------------------
# The HF checkpoint of the live model, streamed bucket by bucket into bounded safetensors shards


def _param_dtypes(model_chunks, arch: ArchConfig) -> dict[str, torch.dtype]:
    """Every parameter's dtype by canonical name, on every rank (collective when distributed): the shard headers are
    written before the tensors, so the writer needs them up front."""
    import torch.distributed as dist

    mine = {name: str(t.dtype).removeprefix("torch.") for name, t in local_parameters(model_chunks, arch).items()}
    if dist.is_initialized():
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        mine = {k: v for d in every for k, v in d.items()}
    return {k: getattr(torch, v) for k, v in mine.items()}


def _hf_plan(arch: ArchConfig, dtypes) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(hf name, shape, dtype)`` of every exported tensor, in the order ``export_hf_tensors`` yields them;
    ``dtypes`` maps a canonical Megatron name (or anything, with a ``defaultdict``) to its dtype."""
    return [(h, tuple(s), dtypes[p.megatron]) for p in export_order(arch) for h, s in zip(p.hf, p.hf_shapes())]


def save_hf_checkpoint(
    model_chunks,
    arch: ArchConfig,
    out,
    tokenizer=None,
    bucket_bytes: int = 512 << 20,
    max_shard_size="2GB",
    merge_lora: bool = True,
) -> None:
    """Write the live model as an HF checkpoint from global rank 0: safetensors shards of at most ``max_shard_size``
    (one ``model.safetensors`` when it fits, else ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``),
    ``config.json`` [+ tokenizer]. Written into a temporary directory next to ``out``, renamed at the end.

    Collective like ``export_hf_tensors``: every rank calls it. Streams: each bucket's tensors are copied to the host
    and appended to the open shard one at a time (``convert._ShardWriter``, the converter's writer), so rank 0 holds at
    most one bucket on the device plus one tensor on the host, never the model; ``export_plan`` gives the numbers.
    """
    import contextlib
    import json
    from pathlib import Path

    import torch.distributed as dist

    from megatron_dapo.bridge.convert import _ShardWriter, parse_size, staged_output
    from megatron_dapo.models.hf_config import hf_from_arch

    max_bytes = parse_size(max_shard_size)
    dtypes = _param_dtypes(model_chunks, arch)
    writes = not dist.is_initialized() or dist.get_rank() == 0
    with staged_output(Path(out)) if writes else contextlib.nullcontext() as tmp:
        writer = _ShardWriter(tmp, _hf_plan(arch, dtypes), max_bytes) if writes else None
        for bucket in export_hf_tensors(model_chunks, arch, bucket_bytes, merge_lora=merge_lora):
            while bucket:  # only rank 0 receives; each tensor is dropped once written
                name, t = bucket.pop(0)
                writer.add(name, t.detach().to("cpu"))
                del t
        if writes:
            writer.close()
            first = dtypes[table_for(arch).params(arch)[0].megatron] if dtypes else torch.float32
            cfg = hf_from_arch(arch, str(first).removeprefix("torch."))
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
    if dist.is_initialized():
        dist.barrier()


# ----------------------------------------------------------------------------------------------------------------------
# The export's plan without a model (a full-scale rehearsal prints it)


@dataclass(frozen=True)
class ExportPlan:
    """What ``save_hf_checkpoint`` does for one architecture and parallel layout; all sizes in bytes."""

    tensors: int  # HF tensors written (no lm_head when tied)
    total_bytes: int  # their sum: the checkpoint's size
    buckets: int  # buckets export_hf_tensors yields to rank 0
    max_bucket_bytes: int  # the largest (bucket_bytes, or one tensor larger than that)
    shards: int  # safetensors files (1: model.safetensors; more: with model.safetensors.index.json)
    max_shard_bytes: int  # the largest file's tensor bytes
    largest_tensor_bytes: int  # the largest HF tensor
    largest_param_bytes: int  # the largest full Megatron parameter (vocabulary padded for TP)
    rank0_device_bytes: int  # global rank 0's extra device memory, at most: a bucket + the parameter in flight
    rank0_host_bytes: int  # global rank 0's extra host memory: the tensor being written (the shard is never held)
    other_device_bytes: int  # any other rank's, at most: the parameter in flight (0 outside replica 0)

    def describe(self) -> str:
        gib = 1 << 30
        return (
            f"hf export: {self.tensors} tensors, {self.total_bytes / gib:.2f} GiB in {self.buckets} buckets "
            f"(largest {self.max_bucket_bytes / gib:.2f} GiB) and {self.shards} shards (largest "
            f"{self.max_shard_bytes / gib:.2f} GiB); peak extra on rank 0: {self.rank0_device_bytes / gib:.2f} GiB "
            f"device + {self.rank0_host_bytes / gib:.2f} GiB host; on other ranks: {self.other_device_bytes / gib:.2f} "
            "GiB device"
        )


def export_plan(
    arch: ArchConfig,
    tp: int = 1,
    pp: int = 1,
    dtype: str | torch.dtype = "bf16",
    bucket_bytes: int = 512 << 20,
    max_shard_size: str | int = "2GB",
) -> ExportPlan:
    """The plan of ``save_hf_checkpoint(..., bucket_bytes, max_shard_size)`` for a model of ``arch`` in ``dtype``
    (``"bf16"``/``"fp16"``/``"fp32"`` or a torch dtype) trained at ``tp`` x ``pp``, without building it.

    Returns an ``ExportPlan`` (bytes throughout): ``tensors`` / ``total_bytes`` of the checkpoint; ``buckets`` and
    ``max_bucket_bytes`` as ``export_hf_tensors`` groups them; ``shards`` and ``max_shard_bytes`` as the writer cuts
    the files; ``largest_tensor_bytes`` (HF) and ``largest_param_bytes`` (full Megatron, padded vocabulary); and the
    peak extra memory per rank during the export: ``rank0_device_bytes`` (the bucket being filled plus the parameter
    in flight: the TP all-gather's buffers and their concatenation, the previous full tensor still referenced; two
    copies at TP 1), ``rank0_host_bytes`` (one tensor on its way to the file) and ``other_device_bytes`` (a TP rank or
    a later stage's sender: the parameter in flight, without a bucket). ``describe()`` puts it on one line.
    """
    from megatron_dapo.bridge.convert import DTYPES, _ShardWriter, parse_size
    from megatron_dapo.bridge.reshard import check_divisible
    from megatron_dapo.models.arch import padded_vocab_size

    check_divisible(arch, tp, pp)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    plan = _hf_plan(arch, defaultdict(lambda: dtype))
    sizes = [(name, int(torch.Size(shape).numel()) * itemsize) for name, shape, _ in plan]
    buckets = [sum(n for _, n in b) for b in _bucketed(iter(sizes), bucket_bytes, size_of=int)]
    files = _ShardWriter(None, plan, parse_size(max_shard_size)).files
    largest_param = 0
    for p in table_for(arch).params(arch):
        shape = list(p.shape())
        if p.mapping.vocab:
            shape[0] = padded_vocab_size(arch.vocab_size, tp)
        largest_param = max(largest_param, int(torch.Size(shape).numel()) * itemsize)
    in_flight = largest_param * (3 if tp > 1 else 2)
    return ExportPlan(
        tensors=len(plan),
        total_bytes=sum(n for _, n in sizes),
        buckets=len(buckets),
        max_bucket_bytes=max(buckets),
        shards=len(files),
        max_shard_bytes=max(sum(e[3] for e in f) for f in files),
        largest_tensor_bytes=max(n for _, n in sizes),
        largest_param_bytes=largest_param,
        rank0_device_bytes=max(buckets) + in_flight,
        rank0_host_bytes=max(n for _, n in sizes),
        other_device_bytes=in_flight if tp > 1 or pp > 1 else 0,
    )
