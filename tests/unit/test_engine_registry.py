"""Every engine the config accepts has a registry entry whose factory resolves, and the transports it takes are the
ones the config allows with it; an unknown engine is named."""

from __future__ import annotations

import importlib
import typing

import pytest

from megatron_dapo.config.run_config import RolloutConfig, load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.engines.registry import ENGINES, engine_spec


def test_each_configurable_engine_is_registered_and_its_factory_resolves():
    hints = typing.get_type_hints(RolloutConfig)
    assert set(typing.get_args(hints["engine"])) == set(ENGINES)
    for spec in ENGINES.values():
        module, _, attr = spec.factory.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), spec


def test_the_registry_and_the_config_agree_on_transports():
    for name, spec in ENGINES.items():
        for sync in ("copy", "tensor", "distributed", "disk"):
            overrides = [f"rollout.engine={name}", f"rollout.weight_sync={sync}", "rollout.colocate=false"]
            if name == "sglang":
                overrides += ["rollout.server_urls=[http://127.0.0.1:1]", "model.hf_init=/x"]
            try:
                load_config("demo_cpu", overrides)
                accepted = True
            except ConfigError:
                accepted = False
            assert accepted == (sync in spec.weight_syncs), (name, sync)


def test_an_unknown_engine_is_named():
    with pytest.raises(ConfigError, match=r"rollout.engine = 'vllm': unknown; known: hf, sglang"):
        engine_spec("vllm")
