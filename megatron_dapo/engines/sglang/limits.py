"""What SGLang 0.5.23 cannot serve of an architecture, by model family: a reason, or None (served). Checked where the
servers' flags are made (``server.server_args``), before any server starts."""

from __future__ import annotations

from collections.abc import Callable


def _qwen3_moe(arch) -> str | None:
    """SGLang 0.5.23 builds every Qwen3-MoE layer sparse, whatever ``mlp_only_layers`` / ``decoder_sparse_step`` say
    (sglang/srt/models/qwen3_moe.py ``Qwen3MoeDecoderLayer.stage_facts``: "all layers are sparse"): a dense layer's
    weights would not load and it would serve another model. Released Qwen3-MoE checkpoints have no dense layer."""
    dense = [i for i, moe in enumerate(arch.moe_layer_pattern()) if not moe]
    if dense:
        return (
            f"layers {dense} are dense (moe_layers), but SGLang 0.5.23 serves every Qwen3-MoE layer as a mixture of "
            "experts (sglang/srt/models/qwen3_moe.py stage_facts); use rollout.engine=hf or an all-MoE architecture"
        )
    return None


LIMITS: dict[str, Callable[..., str | None]] = {"qwen3_moe": _qwen3_moe}  # family name -> check


def cannot_serve(arch) -> str | None:
    check = LIMITS.get(arch.family)
    return check(arch) if check else None
