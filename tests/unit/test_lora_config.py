"""LoRA's settings: what adapter-only sync asks of the config and of the SGLang server's flags."""

from __future__ import annotations

import pytest

from megatron_dapo.config.run_config import load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.engines.registry import lora_adapter_sync
from megatron_dapo.engines.sglang.server import server_args


def test_adapter_sync_is_the_default_on_sglang_and_merged_on_the_hf_engine():
    assert lora_adapter_sync(load_config("demo_cpu_sglang", ["model.lora.rank=8"]))
    assert not lora_adapter_sync(load_config("demo_cpu_sglang", ["model.lora.rank=8", "rollout.lora_sync=merged"]))
    assert not lora_adapter_sync(load_config("demo_cpu_sglang"))  # no LoRA
    assert not lora_adapter_sync(load_config("demo_cpu", ["model.lora.rank=8"]))  # the HF engine takes merged weights
    with pytest.raises(ConfigError, match="rollout.lora_sync"):
        load_config("demo_cpu", ["model.lora.rank=8", "rollout.lora_sync=adapter"])


def test_the_server_gets_lora_flags_with_the_hf_module_names_only_when_it_applies_the_adapters():
    args = server_args(load_config("demo_cpu_sglang", ["model.lora.rank=16", "model.lora.targets=[linear_qkv]"]))
    assert args[args.index("--max-lora-rank") + 1] == "16"
    i = args.index("--lora-target-modules")
    assert args[i + 1 : i + 4] == ["k_proj", "q_proj", "v_proj"]  # the fused QKV as PEFT names it; no "bias"
    assert args[args.index("--lora-backend") + 1] == "torch_native"  # a CPU server: the only backend without Triton
    assert "--enable-lora" in args
    merged = server_args(load_config("demo_cpu_sglang", ["model.lora.rank=16", "rollout.lora_sync=merged"]))
    assert "--enable-lora" not in merged


def test_the_actors_micro_batch_budget_counts_the_adapters_gradients_not_the_bases():
    """The actor sizes its micro-batches by ``memory.actor_memory``: with LoRA the gradients and Adam states are the
    adapters' (the full-size rehearsal of dapo_32b_lora found the actor refusing its layout, counting the base's)."""
    from megatron_dapo.models.arch import load_arch
    from megatron_dapo.models.memory import actor_memory, count_params, lora_params

    arch = load_arch("qwen2.5-32b")
    kw = dict(dtype_bytes=2, tp=8, pp=1, dp=4, layout="thd", distributed_optimizer=True)
    full = actor_memory(arch, 22528, 22528, **kw)
    lora = actor_memory(arch, 22528, 22528, lora_rank=64, **kw)
    adapters = lora_params(arch, 64, tp=8)
    assert full.grads == 4 * count_params(arch, 8, 1, 0) and lora.grads == 4 * adapters
    assert lora.optimizer == 12 * adapters / 4 and lora.weights == 2 * (count_params(arch, 8, 1, 0) + adapters)
    assert lora.activations == full.activations
