"""Tensor- and pipeline-parallel resharding of full Megatron tensors.

Offline: ``split_tp`` / ``merge_tp`` (by the parameter's mapping: column/vocab parallel along dim 0, row parallel along
dim 1, norms replicated, SwiGLU fc1 as ``[gate_shard; up_shard]`` per rank, QKV by whole query groups), PP stage
assignment of layers (layers split evenly; ``stage_of_layer`` / ``global_layer``), EP assignment of experts
(``ep_rank_of_expert``: consecutive blocks of experts / EP), and whole-model ``split_model`` /
``gather_model``. Online: ``gather_tp`` all-gathers one parameter over the tensor-parallel group.

Full tensors here are *unpadded* (the real vocabulary, ``ArchConfig.vocab_size``); TP shards of vocab-parallel tensors
are padded to ``padded_vocab_size(vocab, tp)`` exactly as megatron-core pads them.
"""

from __future__ import annotations

import re

import torch

from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import ArchConfig, check_divisible, padded_vocab_size
from megatron_dapo.models.mapping import Param, canonical_name, spec_name, split_layer
from megatron_dapo.models.registry import table_for

__all__ = [
    "padded_vocab_size",
    "split_tp",
    "merge_tp",
    "stage_of_layer",
    "global_layer",
    "stage_params",
    "local_name",
    "split_model",
    "gather_model",
    "gather_tp",
    "check_divisible",
]


def split_tp(param: Param, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """The ``tp`` shards of a full (unpadded) Megatron tensor, in TP rank order."""
    m = param.mapping
    if m.tp_dim is None:
        return [full] * tp
    if m.vocab:
        padded = padded_vocab_size(param.arch.vocab_size, tp)
        if padded > full.shape[0]:
            full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
    if full.shape[m.tp_dim] % tp:
        raise ConfigError(
            f"{param.megatron}: dim {m.tp_dim} of size {full.shape[m.tp_dim]} is not divisible by tp = {tp}"
        )
    if m.tp_per_block:
        rows = [b.rows for b in param.layout()]
        per_block = [blk.chunk(tp, 0) for blk in full.split(rows, 0)]
        return [torch.cat([chunks[r] for chunks in per_block], 0) for r in range(tp)]
    return [c.clone() for c in full.chunk(tp, m.tp_dim)]


def merge_tp(param: Param, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``split_tp``: the full tensor, vocab padding stripped."""
    m = param.mapping
    if m.tp_dim is None:
        return shards[0]
    if m.tp_per_block:
        tp = len(shards)
        rows = [b.rows // tp for b in param.layout()]
        parts = [s.split(rows, 0) for s in shards]
        full = torch.cat([parts[r][j] for j in range(len(rows)) for r in range(tp)], 0)
    else:
        full = torch.cat(list(shards), m.tp_dim)
    if m.vocab:
        full = full[: param.arch.vocab_size]
    return full


# ----------------------------------------------------------------------------------------------------------------------
# Pipeline stages


def stage_of_layer(layer: int, num_layers: int, pp: int) -> tuple[int, int]:
    """Global layer index → (PP stage, local index on that stage); layers are split evenly."""
    per = num_layers // pp
    return layer // per, layer % per


def global_layer(stage: int, local: int, num_layers: int, pp: int) -> int:
    return stage * (num_layers // pp) + local


def ep_rank_of_expert(expert: int, arch: ArchConfig, ep: int) -> tuple[int, int]:
    """Global expert index → (EP rank, local expert index): each EP rank holds experts / EP consecutive experts
    (megatron-core ``SequentialMLP``: global index = ep_rank · num_local_experts + local index)."""
    per = arch.num_experts // ep
    return expert // per, expert % per


def stage_params(arch: ArchConfig, pp: int, stage: int, ep: int = 1, ep_rank: int = 0) -> list[Param]:
    """The parameters stored on one PP stage and EP rank (every EP rank holds the non-expert parameters; the tied
    output-layer copy is not a ``Param``: see ``split_model``)."""
    out = []
    for p in table_for(arch).params(arch):
        if p.expert is not None and ep_rank_of_expert(p.expert, arch, ep)[0] != ep_rank:
            continue
        if p.layer is not None:
            keep = stage_of_layer(p.layer, arch.num_layers, pp)[0] == stage
        elif p.megatron.startswith("embedding."):
            keep = stage == 0
        else:  # final norm, output layer
            keep = stage == pp - 1
        if keep:
            out.append(p)
    return out


_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(.+)$")
_LOCAL_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def local_name(param: Param, pp: int, te: bool = False, ep: int = 1) -> str:
    """The parameter's name in the model chunk of its stage (local layer index, local expert index; TE or local spec
    spelling)."""
    if param.layer is None:
        return spec_name(param.megatron, te)
    _, rest = split_layer(param.megatron)
    if param.expert is not None:
        rest = _EXPERT_RE.sub(
            lambda m: f"mlp.experts.local_experts.{ep_rank_of_expert(param.expert, param.arch, ep)[1]}.{m.group(2)}",
            rest,
        )
    local = stage_of_layer(param.layer, param.arch.num_layers, pp)[1]
    return spec_name(f"decoder.layers.{local}.{rest}", te)


def canonical_from_local(name: str, stage: int, arch: ArchConfig, pp: int, ep: int = 1, ep_rank: int = 0) -> str:
    """Inverse of ``local_name`` for one stage and EP rank (either spelling)."""
    name = canonical_name(name)
    layer, rest = split_layer(name)
    if layer is None:
        return name
    m = _LOCAL_EXPERT_RE.match(rest)
    if m:
        rest = f"mlp.experts.{ep_rank * (arch.num_experts // ep) + int(m.group(1))}.{m.group(2)}"
    return f"decoder.layers.{global_layer(stage, layer, arch.num_layers, pp)}.{rest}"


Rank = tuple[int, int, int]  # (PP stage, EP rank, TP rank)


def split_model(
    full: dict[str, torch.Tensor], arch: ArchConfig, tp: int, pp: int, te: bool = False, ep: int = 1
) -> dict[Rank, dict[str, torch.Tensor]]:
    """Full canonical tensors → ``{(pp_rank, ep_rank, tp_rank): {local parameter name: shard}}`` as the live model holds
    them (experts split over EP, then over TP like the dense MLP: expert tensor parallelism = TP).

    With tied embeddings and ``pp > 1`` the last stage also holds ``output_layer.weight``, a copy of the embedding
    (megatron-core keeps the two in sync).
    """
    check_divisible(arch, tp, pp, ep=ep)
    table = table_for(arch)
    out: dict[Rank, dict[str, torch.Tensor]] = {(s, e, r): {} for s in range(pp) for e in range(ep) for r in range(tp)}
    for stage in range(pp):
        for e in range(ep):
            for p in stage_params(arch, pp, stage, ep, e):
                for r, shard in enumerate(split_tp(p, full[p.megatron], tp)):
                    out[stage, e, r][local_name(p, pp, te, ep)] = shard
    if arch.tie_embeddings and pp > 1:
        emb = table.by_megatron(arch)["embedding.word_embeddings.weight"]
        for r, shard in enumerate(split_tp(emb, full[emb.megatron], tp)):
            for e in range(ep):
                out[pp - 1, e, r]["output_layer.weight"] = shard.clone()
    return out


def gather_model(
    shards: dict[Rank, dict[str, torch.Tensor]], arch: ArchConfig, tp: int, pp: int, ep: int = 1
) -> dict[str, torch.Tensor]:
    """Inverse of ``split_model`` (either spelling): full canonical tensors, vocab padding stripped. Every EP rank's
    copy of a non-expert parameter is read; the last one wins (they are equal in a live model)."""
    by_megatron = table_for(arch).by_megatron(arch)
    pieces: dict[str, list[torch.Tensor | None]] = {}
    for (stage, ep_rank, rank), named in shards.items():
        for name, t in named.items():
            if name.endswith("._extra_state"):
                continue
            canon = canonical_from_local(name, stage, arch, pp, ep, ep_rank)
            if canon == "output_layer.weight" and arch.tie_embeddings:
                continue  # the last stage's copy of the tied embedding
            if canon not in by_megatron:
                raise ConfigError(f"stage {stage} tp rank {rank}: unexpected parameter {name}")
            pieces.setdefault(canon, [None] * tp)[rank] = t
    out = {}
    for name, p in by_megatron.items():
        got = pieces.get(name)
        if got is None or any(t is None for t in got):
            raise ConfigError(f"missing shard of {name}")
        out[name] = merge_tp(p, got)  # type: ignore[arg-type]
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Online (a live model under torch.distributed)


def gather_tp(param: Param, shard: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather one parameter over the tensor-parallel group (every member must call); returns the full tensor."""
    import torch.distributed as dist

    size = dist.get_world_size(group) if group is not None else 1
    if param.mapping.tp_dim is None or size == 1:
        return merge_tp(param, [shard.detach()])
    shard = shard.detach().contiguous()
    bufs = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(bufs, shard, group=group)
    return merge_tp(param, bufs)
