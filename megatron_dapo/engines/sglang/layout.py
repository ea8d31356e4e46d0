"""What an SGLang server holds for the HF tensors we send, and the checksums its /weights_checker reports for them.

SGLang 0.5.23 keeps the decoder families we train (each family's file in ``models/`` names its SGLang model file) in
its own layout: ``q_proj``/``k_proj``/``v_proj`` fused into ``qkv_proj`` and
``gate_proj``/``up_proj`` into ``gate_up_proj`` (their ``stacked_params_mapping``), each TP rank holding its shard
(sglang/srt/layers/linear.py: column-parallel along dim 0, with KV heads replicated when TP exceeds their number;
``o_proj``/``down_proj`` row-parallel along dim 1), and the vocabulary padded with zero rows to a multiple of 64 (x TP
when needed), split in equal row blocks (sglang/srt/layers/vocab_parallel_embedding.py). Per-head ``q_norm`` /
``k_norm`` weights are plain ``RMSNorm(head_dim)`` replicated on every rank (the same ``load_weights`` fuses the
same five projections), so they need no rule of their own. A mixture of experts (sglang/srt/layers/moe/fused_moe_triton/
layer.py ``FusedMoE``) holds each layer's experts as two stacked parameters, ``mlp.experts.w13_weight`` [E, 2F/TP, H]
(per expert ``gate_proj`` rows then ``up_proj`` rows, each the rank's slice: ``_load_w13``) and ``mlp.experts.w2_weight``
[E, H, F/TP] (``down_proj``'s columns: ``_load_w2``); the router ``mlp.gate`` is replicated. ``/weights_checker {"action":
"checksum"}`` answers one hash per parameter per TP rank (sglang/srt/utils/weight_checker.py ``_hash_tensor``).

``ServerChecksums`` rebuilds those shards from the tensors we send, cast to the server's dtype, and hashes them the way
the server does, so a sync is verified tensor by tensor on any model SGLang serves, including those where
/get_weights_by_name answers 400. Tests check the whole mapping against the real server.
"""

from __future__ import annotations

import hashlib
import re

import torch

from megatron_dapo.types import WeightSyncError

# HF projection -> (SGLang fused parameter, slot); the order of the slots is the order of the concatenation.
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
FUSED |= {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
SLOTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
VOCAB_PADDING = 64  # DEFAULT_VOCAB_PADDING_SIZE
_PROJ = re.compile(r"^(.*\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def server_tensor_hash(t: torch.Tensor) -> str:
    """The hash /weights_checker reports for a parameter: ``f"{tensor_hash(t):016x}"`` (sglang/srt/utils/
    weight_checker.py) with ``tensor_hash`` from sglang/srt/managers/mm_utils.py: the first 8 bytes of the SHA-256
    of the raw bytes for a CPU tensor, SGLang's own GPU kernel for a CUDA tensor."""
    if t.is_cuda:  # the server's GPU hash is a kernel of its own: call it (sglang is installed wherever GPUs are)
        from sglang.srt.managers.mm_utils import tensor_hash

        return f"{tensor_hash(t.contiguous()):016x}"
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).digest()[:8].hex()


def _pad_rows(vocab: int, tp: int) -> int:
    padding = VOCAB_PADDING
    if -(-vocab // padding) * padding % tp:
        padding *= tp
    return -(-vocab // padding) * padding


class ServerChecksums:
    """Collects the sent tensors (``add``) and returns the expected ``{(sglang_name, tp_rank): hash}`` (``result``).

    Tensors are cast to ``dtype`` on ``device`` (the server's) first; the parts of a fused parameter are kept until
    all have arrived. ``head_dim`` is needed only when TP exceeds the number of KV heads (to replicate them)."""

    def __init__(self, dtype: torch.dtype, device: str | torch.device, tp_size: int = 1, head_dim: int | None = None):
        self.dtype, self.device, self.tp, self.head_dim = dtype, torch.device(device), tp_size, head_dim
        self.expected: dict[tuple[str, int], str] = {}
        self.sources: dict[str, list[str]] = {}  # SGLang name -> the HF names it is built from
        self._parts: dict[str, dict[int, torch.Tensor]] = {}
        # a layer's experts, {prefix: {(expert, proj): tensor}} on the host until the layer's last one has come (the
        # export sends them layer by layer: a tensor of another layer closes the open ones)
        self._experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        e = _EXPERT.match(name)
        if e is not None:
            prefix, expert, proj = e.groups()
            for other in [p for p in self._experts if p != prefix]:
                self._finish_experts(other)
            self._experts.setdefault(prefix, {})[(int(expert), proj)] = tensor.detach().to("cpu", self.dtype)
            return
        t = tensor.detach().to(self.device, self.dtype)
        m = _PROJ.match(name)
        if m is None:
            self._finish(name, [name], t)
            return
        prefix, proj, kind = m.groups()
        fused, slot = FUSED[proj]
        target = f"{prefix}{fused}.{kind}"
        parts = self._parts.setdefault(target, {})
        parts[slot] = t
        if len(parts) == len(SLOTS[fused]):
            del self._parts[target]
            names = [f"{prefix}{p}.{kind}" for p in SLOTS[fused]]
            self._finish(target, names, *(parts[i] for i in range(len(names))))

    def result(self) -> dict[tuple[str, int], str]:
        for prefix in list(self._experts):
            self._finish_experts(prefix)
        if self._parts:
            target, parts = next(iter(self._parts.items()))
            raise WeightSyncError(
                f"weight sync: {target!r} on the server fuses {len(SLOTS[target.split('.')[-2]])} HF tensors but only "
                f"slots {sorted(parts)} were sent"
            )
        return self.expected

    def describe(self, key: tuple[str, int]) -> str:
        """The HF tensor(s) behind one server parameter, for error messages."""
        name, rank = key
        sources = self.sources.get(name, [name])
        text = " + ".join(repr(s) for s in sources)
        if sources != [name]:
            text += f" (fused as {name!r} on the server)"
        return text + (f" [TP rank {rank}]" if self.tp > 1 else "")

    def _finish_experts(self, prefix: str) -> None:
        parts = self._experts.pop(prefix)
        count = 1 + max(e for e, _ in parts)
        missing = [
            f"{e}.{p}" for e in range(count) for p in ("gate_proj", "up_proj", "down_proj") if (e, p) not in parts
        ]
        if missing:
            raise WeightSyncError(f"weight sync: {prefix}w13_weight / w2_weight: experts {missing[:4]} were not sent")
        tp = self.tp
        for rank in range(tp):
            w13 = torch.stack(
                [
                    torch.cat([parts[(e, "gate_proj")].chunk(tp)[rank], parts[(e, "up_proj")].chunk(tp)[rank]])
                    for e in range(count)
                ]
            )
            w2 = torch.stack([parts[(e, "down_proj")].chunk(tp, dim=1)[rank] for e in range(count)])
            for target, shard, projs in (
                (f"{prefix}w13_weight", w13, "gate_proj/up_proj"),
                (f"{prefix}w2_weight", w2, "down_proj"),
            ):
                self.sources[target] = [f"{prefix}<0..{count - 1}>.{projs}.weight"]
                self.expected[(target, rank)] = server_tensor_hash(shard.to(self.device))

    def _finish(self, target: str, names: list[str], *parts: torch.Tensor) -> None:
        self.sources[target] = names
        for rank, shard in enumerate(self._shards(target, parts)):
            self.expected[(target, rank)] = server_tensor_hash(shard)

    def _shards(self, target: str, parts: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        tp = self.tp
        if target.endswith("qkv_proj.weight") or target.endswith("qkv_proj.bias"):
            q, k, v = parts
            return [torch.cat([q.chunk(tp)[r], self._kv_shard(k, r), self._kv_shard(v, r)]) for r in range(tp)]
        if len(parts) > 1:  # gate_up_proj: column-parallel, each part split along dim 0
            return [torch.cat([p.chunk(tp)[r] for p in parts]) for r in range(tp)]
        (t,) = parts
        if target in VOCAB:
            rows = _pad_rows(t.shape[0], tp)
            if rows != t.shape[0]:  # zero rows up to the padded size (a copy only when padding is needed)
                t = torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
            return list(t.chunk(tp))
        if tp == 1 or t.dim() < 2 or not target.endswith(ROW_PARALLEL):
            return [t] * tp  # replicated (norms, row-parallel biases)
        return list(t.chunk(tp, dim=1))

    def _kv_shard(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        tp = self.tp
        if tp == 1:
            return t
        heads = t.shape[0] // self.head_dim if self.head_dim else None
        if heads is None or heads >= tp:
            if t.shape[0] % tp:
                raise WeightSyncError(f"weight sync: {t.shape[0]} KV rows do not split over TP {tp}; give head_dim")
            return t.chunk(tp)[rank]
        replicas = tp // heads  # each KV head serves tp / heads ranks (QKVParallelLinear)
        return t.chunk(heads)[rank // replicas]
