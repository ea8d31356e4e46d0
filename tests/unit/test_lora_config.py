"""LoRA's settings: what adapter-only sync asks of the config and of the SGLang server's flags."""

from __future__ import annotations

import pytest

from megatron_dapo.config.run_config import load_config, lora_adapter_sync
from megatron_dapo.config.typed_yaml import ConfigError
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
