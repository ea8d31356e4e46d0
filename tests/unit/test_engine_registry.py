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


def _engine_name_comparisons(source: str) -> list[int]:
    """Lines comparing something's ``.engine`` with a string (``r.engine == "sglang"``, ``engine in ("hf", ...)``)."""
    import ast

    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        engine = any(isinstance(s, ast.Attribute) and s.attr == "engine" for s in sides)
        names = [c for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        if engine and names:
            lines.append(node.lineno)
    return lines


# the config's engine keys and their checks move into each engine's own block next (issue 50): until then config/
# still names SGLang's keys; everything else asks the spec
ASKS_THE_SPEC = ("loop", "launch", "planning", "actor", "sync", "bridge", "models", "algo", "data", "rollouts")


def test_outside_engines_nothing_compares_the_engine_to_a_name():
    from tests.helpers import REPO

    found = []
    for package in ASKS_THE_SPEC:
        for path in sorted((REPO / "megatron_dapo" / package).rglob("*.py")):
            found += [f"{path.relative_to(REPO)}:{n}" for n in _engine_name_comparisons(path.read_text())]
    assert found == [], f"ask engines.registry.engine_spec(rollout.engine) instead: {found}"
    # the check sees what it looks for
    assert _engine_name_comparisons('if cfg.rollout.engine == "sglang" and x:\n    pass\n') == [1]
    assert _engine_name_comparisons('ok = r.engine in ("hf", "vllm")\n') == [1]
    assert _engine_name_comparisons("same = a.engine == b.engine\n") == []


def test_the_spec_answers_what_the_loop_and_launch_ask():
    hf, sg = engine_spec("hf"), engine_spec("sglang")
    gpu = load_config(
        "demo_cpu_sglang", ["rollout.sglang_device=cuda", "rollout.sglang_tp=2", "rollout.server_urls=[http://h:1]"]
    )
    cpu = load_config("demo_cpu_sglang")
    assert (sg.tp(gpu), sg.on_gpus(gpu), sg.on_gpus(cpu), hf.tp(cpu), hf.on_gpus(cpu)) == (2, True, False, 1, False)
    assert sg.servers and not hf.servers and sg.same_node_syncs == ("tensor",) and hf.same_node_syncs == ()
    for spec in ENGINES.values():  # every named callable resolves
        for field in ("factory", "sync_factory", "adapter_sync_factory", "attach_factory", "concurrency", "tp_of",
                      "device_of", "launch_command_factory", "launch_env_factory"):  # fmt: skip
            target = getattr(spec, field)
            if target:
                module, _, attr = target.partition(":")
                assert callable(getattr(importlib.import_module(module), attr)), (spec.name, field)
