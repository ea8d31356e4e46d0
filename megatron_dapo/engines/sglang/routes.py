"""The routed experts an SGLang server returns with each response (``--enable-return-routed-experts``; the request's
``return_routed_experts``), read into ``Sample.routes`` for routing replay (``actor/routes.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.types import RolloutError


@dataclass(frozen=True)
class RouteLayout:
    """How to read a response's ``meta_info.routed_experts`` into ``Sample.routes``: SGLang returns every layer's top-k
    (``num_layers`` rows per token, a dense layer's row unused); the samples keep the MoE layers, int16."""

    num_layers: int
    moe_layers: tuple[int, ...]
    topk: int

    @classmethod
    def of(cls, cfg) -> RouteLayout | None:
        """The layout of ``cfg``'s model when it is a mixture of experts (``models.arch.routes_wanted``), else None."""
        from megatron_dapo.models.arch import load_arch, routes_wanted

        arch = load_arch(cfg.model.arch)
        if not routes_wanted(cfg.rollout.routing_replay, arch):
            return None
        moe = tuple(i for i, m in enumerate(arch.moe_layer_pattern()) if m)
        return cls(arch.num_layers, moe, arch.moe_topk)

    def decode(self, encoded: str | None, seq_len: int, rid: str):
        """[seq_len - 1, MoE layers, top-k] int16 from the base64 int32 the server sends; no routes, or routes of
        another shape, are a RolloutError naming the request (replay must never silently go without them)."""
        import base64

        import numpy as np
        import torch

        if not encoded:
            raise RolloutError(
                f"request {rid}: the server returned no routed experts, which an MoE run replays or compares "
                "(rollout.routing_replay); start it with --enable-return-routed-experts (dapo's servers get it from the "
                "config)"
            )
        flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
        rows = seq_len - 1
        if flat.size != rows * self.num_layers * self.topk:
            raise RolloutError(
                f"request {rid}: {flat.size} routed-expert ids, expected {rows} positions × {self.num_layers} layers "
                f"× top-{self.topk}"
            )
        routes = torch.from_numpy(flat.reshape(rows, self.num_layers, self.topk)[:, list(self.moe_layers)].copy())
        return routes.to(torch.int16)
