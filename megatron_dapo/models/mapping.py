"""Declarative HF ⇄ Megatron parameter mappings, one table per architecture family.

A *canonical* Megatron name is the local-spec ``named_parameters()`` name with the GLOBAL layer index
(``decoder.layers.7.input_layernorm.weight``); Transformer Engine spells two of them differently (the norms fused into
the next linear), see ``canonical_name`` / ``spec_name``. Each ``Mapping`` ties one canonical Megatron parameter to
the HF tensors it is made of and says how it is laid out and split for tensor parallelism:

* the Megatron tensor is the concatenation along dim 0 of equal-sized row ``Block``s, each a slice of one HF tensor
  (``layout``) — one block for a plain copy, ``nq + 2·nkv`` head blocks for the fused QKV interleaved per query group,
  ``[gate; up]`` for the fused SwiGLU fc1. Both directions and the streamed checkpoint pieces derive from it;
* ``tp_dim`` (0 column / vocab parallel, 1 row parallel, None replicated) and ``tp_per_block`` (each TP rank takes its
  share of every block: fc1 = per rank ``[gate_shard; up_shard]``; otherwise contiguous chunks, which for QKV are
  whole query groups);
* ``vocab``: rows padded to the TP-padded vocabulary inside Megatron, stripped on the way out.

A family's file in ``models/`` builds its ``MappingTable`` from these (``registry.table_for`` selects it by the
architecture's family, never by model name).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatron_dapo.config.typed_yaml import ConfigError

if TYPE_CHECKING:
    from megatron_dapo.models.arch import ArchConfig

# Transformer Engine fuses the pre-attention / pre-MLP norms into the following linear layer.
TE_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def canonical_name(name: str) -> str:
    """Local-spec spelling of a Megatron parameter name (TE ``layer_norm_weight`` → ``*_layernorm.weight``)."""
    m = _LAYER_RE.match(name)
    if m:
        for local, te in TE_ALIASES.items():
            if m.group(2) == te:
                return f"decoder.layers.{m.group(1)}.{local}"
    return name


def spec_name(canonical: str, te: bool) -> str:
    """The name a parameter has in a model built with the TE (``te=True``) or the local layer spec."""
    m = _LAYER_RE.match(canonical)
    if te and m and m.group(2) in TE_ALIASES:
        return f"decoder.layers.{m.group(1)}.{TE_ALIASES[m.group(2)]}"
    return canonical


def split_layer(name: str) -> tuple[int | None, str]:
    """``decoder.layers.3.mlp.linear_fc2.weight`` → ``(3, "mlp.linear_fc2.weight")``; other names → ``(None, name)``."""
    m = _LAYER_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def checkpoint_key(canonical: str, te: bool = False) -> tuple[str, int | None]:
    """dist_checkpointing key of a parameter and its layer index along the stacked leading axis, e.g.
    ``decoder.layers.3.input_layernorm.weight`` → ``("decoder.layers.input_layernorm.weight", 3)``.

    The actor stores canonical (local-spec) keys (``actor/checkpoint.py``); ``te=True`` gives the spelling of
    megatron-core's own ``GPTModel.sharded_state_dict()`` (TE names for both specs), accepted when reading.
    """
    layer, rest = split_layer(canonical)
    if layer is None:
        return canonical, None
    return "decoder.layers." + (TE_ALIASES.get(rest, rest) if te else rest), layer


def checkpoint_axes(param: Param, te: bool = False) -> tuple[str, tuple[tuple[int, int], ...]]:
    """dist_checkpointing key of a parameter and its ``(index, count)`` on each leading axis of the stored tensor, the
    way ``GPTModel.sharded_state_dict()`` of megatron-core 0.16.1 writes them:

    * a dense model stacks the layers (transformer/transformer_block.py ``sharded_state_dict``: one key per parameter
      name, the layer on a leading axis): ``("decoder.layers.input_layernorm.weight", ((3, L),))``;
    * a model with MoE layers (``moe_layer_freq`` a list: ``non_homogeneous_layers``) keys each layer by its global
      index, and each expert's weight sits on a leading expert axis (transformer/moe/experts.py
      ``SequentialMLP.sharded_state_dict``): ``("decoder.layers.3.mlp.experts.experts.linear_fc1.weight", ((e, E),))``.
    """
    key, layer = checkpoint_key(param.megatron, te)
    if layer is None:
        return key, ()
    if not param.arch.is_moe:
        return key, ((layer, param.arch.num_layers),)
    key = key.replace("layers.", f"layers.{layer}.", 1)
    if param.expert is None:
        return key, ()
    key = re.sub(r"\.mlp\.experts\.\d+\.", ".mlp.experts.experts.", key)
    return key, ((param.expert, param.arch.num_experts),)


@dataclass(frozen=True)
class Block:
    """Rows ``[start, start + rows)`` of the ``src``-th HF tensor of a mapping."""

    src: int
    start: int
    rows: int


ShapeFn = Callable[["ArchConfig"], tuple[int, ...]]


@dataclass(frozen=True)
class Mapping:
    """One Megatron parameter ⇄ one or more HF tensors. ``*`` in names stands for the global layer index."""

    megatron: str
    hf: tuple[str, ...]
    shapes: tuple[ShapeFn, ...]  # HF tensor shapes from the architecture, one per ``hf`` name
    tp_dim: int | None = None
    tp_per_block: bool = False
    vocab: bool = False
    when: Callable[[ArchConfig], bool] | None = None
    layer_when: Callable[[ArchConfig, int], bool] | None = None  # which layers have it (MoE vs dense MLP layers)

    @property
    def per_layer(self) -> bool:
        return "*" in self.megatron

    @property
    def per_expert(self) -> bool:
        """``#`` in the names stands for the GLOBAL expert index (canonical ``decoder.layers.*.mlp.experts.#.…``)."""
        return "#" in self.megatron

    def hf_shapes(self, arch: ArchConfig) -> list[tuple[int, ...]]:
        return [tuple(fn(arch)) for fn in self.shapes]

    def layout(self, arch: ArchConfig) -> list[Block]:
        """Equal-sized row blocks whose concatenation (dim 0) is the Megatron tensor; default: one plain copy."""
        return [Block(0, 0, self.hf_shapes(arch)[0][0])]

    def megatron_shape(self, arch: ArchConfig) -> tuple[int, ...]:
        rest = self.hf_shapes(arch)[0][1:]
        return (sum(b.rows for b in self.layout(arch)), *rest)


def AutoMapping(megatron: str, hf: str, shape: ShapeFn, tp_dim: int | None = None, **kw) -> Mapping:  # noqa: N802
    """A one-to-one copy (norms, o_proj, down_proj, embeddings, lm_head)."""
    return Mapping(megatron, (hf,), (shape,), tp_dim=tp_dim, **kw)


@dataclass(frozen=True)
class QKVMapping(Mapping):
    """Fused ``linear_qkv`` (weight or bias) ← q, k, v: per KV group g ``[q heads of g; k_g; v_g]``, head_dim rows each."""

    tp_dim: int | None = 0

    def layout(self, arch: ArchConfig) -> list[Block]:
        hd, nq, nkv = arch.head_dim, arch.num_attention_heads, arch.num_query_groups
        per_group = nq // nkv
        blocks = []
        for g in range(nkv):
            blocks += [Block(0, (g * per_group + j) * hd, hd) for j in range(per_group)]
            blocks += [Block(1, g * hd, hd), Block(2, g * hd, hd)]
        return blocks


def qkv_mapping(megatron: str, q: str, k: str, v: str, bias: bool, **kw) -> QKVMapping:
    def shape(heads: Callable[[ArchConfig], int]) -> ShapeFn:
        if bias:
            return lambda a: (heads(a) * a.head_dim,)
        return lambda a: (heads(a) * a.head_dim, a.hidden_size)

    nq, nkv = (lambda a: a.num_attention_heads), (lambda a: a.num_query_groups)
    return QKVMapping(megatron, (q, k, v), (shape(nq), shape(nkv), shape(nkv)), **kw)


def dense_width(a: ArchConfig) -> int:
    return a.ffn_hidden_size


def expert_width(a: ArchConfig) -> int:
    return a.moe_ffn_hidden_size


@dataclass(frozen=True)
class GatedMLPMapping(Mapping):
    """SwiGLU ``linear_fc1`` ← ``[gate; up]``; each TP rank holds ``[gate_shard; up_shard]``."""

    tp_dim: int | None = 0
    tp_per_block: bool = True
    width: Callable[[ArchConfig], int] = dense_width  # the FFN width: the dense MLP's or one expert's

    def layout(self, arch: ArchConfig) -> list[Block]:
        return [Block(0, 0, self.width(arch)), Block(1, 0, self.width(arch))]


def gated_mlp_mapping(megatron: str, gate: str, up: str, width=dense_width, **kw) -> GatedMLPMapping:
    shape: ShapeFn = lambda a: (width(a), a.hidden_size)  # noqa: E731
    return GatedMLPMapping(megatron, (gate, up), (shape, shape), width=width, **kw)


def mlp_mappings(prefix: str, width=dense_width, **kw) -> tuple[Mapping, ...]:
    """A SwiGLU MLP: ``{prefix}.gate_proj`` / ``up_proj`` → ``linear_fc1``, ``down_proj`` → ``linear_fc2``; ``prefix``
    pairs the Megatron and HF module paths as ``(megatron, hf)``."""
    mg, hf = prefix
    return (
        gated_mlp_mapping(f"{mg}.linear_fc1.weight", f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight", width, **kw),
        AutoMapping(
            f"{mg}.linear_fc2.weight", f"{hf}.down_proj.weight", lambda a: (a.hidden_size, width(a)), tp_dim=1, **kw
        ),
    )


# ----------------------------------------------------------------------------------------------------------------------
# Concrete parameters of one architecture


@dataclass(frozen=True)
class Param:
    """A mapping instantiated for one layer: concrete names plus the transforms both ways."""

    mapping: Mapping
    arch: ArchConfig = field(repr=False)
    layer: int | None
    megatron: str
    hf: tuple[str, ...]
    expert: int | None = None  # global expert index of an expert's weight

    def hf_shapes(self) -> list[tuple[int, ...]]:
        return self.mapping.hf_shapes(self.arch)

    def layout(self) -> list[Block]:
        return self.mapping.layout(self.arch)

    def shape(self) -> tuple[int, ...]:
        return self.mapping.megatron_shape(self.arch)

    def to_megatron(self, tensors: list[torch.Tensor], padded_vocab: int | None = None) -> torch.Tensor:
        """Full (unsharded) Megatron tensor from the HF tensors (in ``hf`` order); vocab rows padded with zeros."""
        blocks = [tensors[b.src].narrow(0, b.start, b.rows) for b in self.layout()]
        out = blocks[0].clone() if len(blocks) == 1 else torch.cat(blocks, 0)
        if self.mapping.vocab and padded_vocab and padded_vocab > out.shape[0]:
            out = torch.cat([out, out.new_zeros(padded_vocab - out.shape[0], *out.shape[1:])])
        return out

    def to_hf(self, full: torch.Tensor) -> list[torch.Tensor]:
        """HF tensors (in ``hf`` order) from the full Megatron tensor; vocab padding stripped."""
        if self.mapping.vocab:
            full = full[: self.arch.vocab_size]
        parts: dict[int, list[tuple[int, torch.Tensor]]] = {}
        row = 0
        for b in self.layout():
            parts.setdefault(b.src, []).append((b.start, full.narrow(0, row, b.rows)))
            row += b.rows
        if row != full.shape[0]:
            raise ValueError(f"{self.megatron}: {full.shape[0]} rows, layout expects {row}")
        out = []
        for src in range(len(self.hf)):
            chunks = [t for _, t in sorted(parts[src], key=lambda x: x[0])]
            out.append(chunks[0].clone() if len(chunks) == 1 else torch.cat(chunks, 0))
        return out

    def pieces(self, src: int, tensor: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """``(fragment index, rows)`` of one HF tensor inside the Megatron tensor (fragments: ``len(layout())``)."""
        return [(i, tensor.narrow(0, b.start, b.rows)) for i, b in enumerate(self.layout()) if b.src == src]


def _fill(template: str, layer: int | None, expert: int | None = None) -> str:
    out = template.replace("*", str(layer)) if layer is not None else template
    return out.replace("#", str(expert)) if expert is not None else out


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\*", r"(\d+)").replace("\\#", r"(\d+)") + "$")


@dataclass(frozen=True)
class MappingTable:
    family: str
    mappings: tuple[Mapping, ...]
    # HF tensors that may be present and are not parameters (old checkpoints store rotary buffers).
    ignored_hf: tuple[str, ...] = ("model.layers.*.self_attn.rotary_emb.inv_freq",)
    # HF names that may be present although no mapping uses them: a tied lm_head (a copy of the embedding).
    tied_hf: tuple[str, ...] = ("lm_head.weight",)

    def params(self, arch: ArchConfig) -> list[Param]:
        """Every parameter of the architecture in model order (embedding, layers 0..L-1, final norm, output)."""
        out = []
        for m in self.mappings:
            if m.when is not None and not m.when(arch):
                continue
            layers = range(arch.num_layers) if m.per_layer else [None]
            experts = range(arch.num_experts) if m.per_expert else [None]
            for i in layers:
                if m.layer_when is not None and not m.layer_when(arch, i):
                    continue
                for e in experts:
                    hf = tuple(_fill(h, i, e) for h in m.hf)
                    out.append(Param(m, arch, i, _fill(m.megatron, i, e), hf, e))
        order = {m: k for k, m in enumerate(self.mappings)}
        return sorted(out, key=lambda p: (_order(p.megatron), p.layer or 0, order[p.mapping], p.expert or 0))

    def hf_shapes(self, arch: ArchConfig) -> dict[str, tuple[int, ...]]:
        return {h: s for p in self.params(arch) for h, s in zip(p.hf, p.hf_shapes())}

    def is_ignorable_hf(self, name: str, arch: ArchConfig) -> bool:
        if any(_pattern(t).match(name) for t in self.ignored_hf):
            return True
        return arch.tie_embeddings and name in self.tied_hf

    def by_megatron(self, arch: ArchConfig) -> dict[str, Param]:
        return {p.megatron: p for p in self.params(arch)}

    def by_hf(self, arch: ArchConfig) -> dict[str, tuple[Param, int]]:
        return {h: (p, i) for p in self.params(arch) for i, h in enumerate(p.hf)}

    def hf_to_megatron(
        self, hf: MappingABC[str, torch.Tensor], arch: ArchConfig, padded_vocab: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Full canonical Megatron tensors from a complete dict of HF tensors."""
        out = {}
        for p in self.params(arch):
            missing = [h for h in p.hf if h not in hf]
            if missing:
                raise ConfigError(f"missing HF tensor {missing[0]} (for {p.megatron})")
            out[p.megatron] = p.to_megatron([hf[h] for h in p.hf], padded_vocab)
        return out

    def megatron_to_hf(self, full: MappingABC[str, torch.Tensor], arch: ArchConfig) -> dict[str, torch.Tensor]:
        """HF tensors from full canonical Megatron tensors (no lm_head when tied)."""
        out = {}
        for p in self.params(arch):
            if p.megatron not in full:
                raise ConfigError(f"missing Megatron tensor {p.megatron}")
            out.update(zip(p.hf, p.to_hf(full[p.megatron])))
        return out


def _order(name: str) -> int:
    if name.startswith("embedding."):
        return 0
    if name.startswith("decoder.layers."):
        return 1
    return 2 if name.startswith("decoder.") else 3


# ----------------------------------------------------------------------------------------------------------------------
# The decoder most families share


def hidden_shape(a: ArchConfig) -> tuple[int, ...]:
    return (a.hidden_size,)


def head_shape(a: ArchConfig) -> tuple[int, ...]:
    return (a.head_dim,)


def qk_norm_mappings() -> tuple[Mapping, ...]:
    """Per-head RMSNorm on q and k: one [head_dim] weight each, shared by all heads, replicated over TP.
    megatron-core ``qk_layernorm=True`` builds ``self_attention.q_layernorm`` / ``k_layernorm`` with the same names in
    the TE spec (TENorm) and the local spec (WrappedTorchNorm) (megatron-core 0.16.1 models/gpt/gpt_layer_specs.py,
    ``SelfAttentionSubmodules(q_layernorm=..., k_layernorm=...)`` in both ``get_gpt_layer_*_spec``)."""
    attn = "model.layers.*.self_attn"
    return (
        AutoMapping("decoder.layers.*.self_attention.q_layernorm.weight", f"{attn}.q_norm.weight", head_shape),
        AutoMapping("decoder.layers.*.self_attention.k_layernorm.weight", f"{attn}.k_norm.weight", head_shape),
    )


def decoder_mappings(extra: tuple[Mapping, ...] = (), mlp: tuple[Mapping, ...] | None = None) -> tuple[Mapping, ...]:
    """The HF decoder naming most families share (``model.layers.*.self_attn.q_proj`` ..., ``mlp.gate_proj`` ...,
    ``lm_head`` unless tied), with the QKV bias when ``ArchConfig.qkv_bias``; ``extra`` goes after the QKV mappings,
    ``mlp`` replaces the dense SwiGLU MLP (a mixture of experts)."""
    attn = "model.layers.*.self_attn"
    return (
        AutoMapping(
            "embedding.word_embeddings.weight",
            "model.embed_tokens.weight",
            lambda a: (a.vocab_size, a.hidden_size),
            tp_dim=0,
            vocab=True,
        ),
        AutoMapping("decoder.layers.*.input_layernorm.weight", "model.layers.*.input_layernorm.weight", hidden_shape),
        qkv_mapping(
            "decoder.layers.*.self_attention.linear_qkv.weight",
            f"{attn}.q_proj.weight",
            f"{attn}.k_proj.weight",
            f"{attn}.v_proj.weight",
            bias=False,
        ),
        qkv_mapping(
            "decoder.layers.*.self_attention.linear_qkv.bias",
            f"{attn}.q_proj.bias",
            f"{attn}.k_proj.bias",
            f"{attn}.v_proj.bias",
            bias=True,
            when=lambda a: a.qkv_bias,
        ),
        *extra,
        AutoMapping(
            "decoder.layers.*.self_attention.linear_proj.weight",
            f"{attn}.o_proj.weight",
            lambda a: (a.hidden_size, a.num_attention_heads * a.head_dim),
            tp_dim=1,
        ),
        AutoMapping(
            "decoder.layers.*.pre_mlp_layernorm.weight", "model.layers.*.post_attention_layernorm.weight", hidden_shape
        ),
        *(mlp if mlp is not None else mlp_mappings(("decoder.layers.*.mlp", "model.layers.*.mlp"))),
        AutoMapping("decoder.final_layernorm.weight", "model.norm.weight", hidden_shape),
        AutoMapping(
            "output_layer.weight",
            "lm_head.weight",
            lambda a: (a.vocab_size, a.hidden_size),
            tp_dim=0,
            vocab=True,
            when=lambda a: not a.tie_embeddings,
        ),
    )
