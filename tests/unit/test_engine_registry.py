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
            if spec.servers:
                overrides += ["rollout.server_urls=[http://127.0.0.1:1]", "model.hf_init=/x"]
            try:
                load_config("demo_cpu", overrides)
                accepted = True
            except ConfigError:
                accepted = False
            assert accepted == (sync in spec.weight_syncs), (name, sync)


def test_an_unknown_engine_is_named():
    with pytest.raises(ConfigError, match=r"rollout.engine = 'trtllm': unknown; known: hf, sglang, vllm"):
        engine_spec("trtllm")


def _names_an_engine(source: str) -> list[str]:
    """Where code names an engine: ``.engine`` compared with or assigned a string (``r.engine == "sglang"``,
    ``engine in ("hf", ...)``), an engine's config block (``cfg.rollout.sglang``), an import of an engine's module
    (``megatron_dapo.engines.sglang...``, ``engines.hf``; the registry and ``engines.base`` are the seam)."""
    import ast

    names, out = set(ENGINES), []

    def strings(node):
        return [c for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]

    def is_engine(node):
        return isinstance(node, ast.Attribute) and node.attr == "engine"

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(map(is_engine, [node.left, *node.comparators])):
            if any(strings(s) for s in [node.left, *node.comparators]):
                out.append(f"{node.lineno}: compares .engine to a name")
        elif isinstance(node, ast.Assign) and any(map(is_engine, node.targets)) and strings(node.value):
            out.append(f"{node.lineno}: assigns .engine a name")
        elif isinstance(node, ast.Attribute) and node.attr in names and getattr(node.value, "attr", "") == "rollout":
            out.append(f"{node.lineno}: rollout.{node.attr}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            mods += [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else []
            for m in mods:
                part = m.split(".")[2] if m.startswith("megatron_dapo.engines.") else ""
                if any(part == n or part.startswith(n + "_") for n in names):
                    out.append(f"{node.lineno}: imports {m}")
    return out


def test_outside_engines_nothing_names_an_engine():
    """The seam (issue 50): the config, loop, launch and planning ask ``engines.registry``; only ``engines/`` knows an
    engine by name. The registry itself names them (``DEFAULT_ENGINE``, ``GPU_ENGINE``), and so may a module's text."""
    from tests.helpers import REPO

    found = []
    for path in sorted((REPO / "megatron_dapo").rglob("*.py")):
        if path.relative_to(REPO / "megatron_dapo").parts[0] != "engines":
            found += [f"{path.relative_to(REPO)}:{hit}" for hit in _names_an_engine(path.read_text())]
    assert found == [], f"ask engines.registry.engine_spec(rollout.engine) instead: {found}"
    # the check sees each form it looks for, and not the engine object's own attribute
    assert _names_an_engine('if cfg.rollout.engine == "sglang" and x:\n    pass\n') == ["1: compares .engine to a name"]
    assert _names_an_engine('ok = r.engine in ("hf", "vllm")\n') == ["1: compares .engine to a name"]
    assert _names_an_engine('r.engine = "hf"\n') == ["1: assigns .engine a name"]
    assert _names_an_engine("tp = cfg.rollout.sglang.tp\n") == ["1: rollout.sglang"]
    assert _names_an_engine("from megatron_dapo.engines.sglang.memory import x\n") == [
        "1: imports megatron_dapo.engines.sglang.memory", "1: imports megatron_dapo.engines.sglang.memory.x"]  # fmt: skip
    assert _names_an_engine("from megatron_dapo.engines import hf_options\n") == [
        "1: imports megatron_dapo.engines.hf_options"]  # fmt: skip
    assert _names_an_engine("same = a.engine == b.engine\nself.engine = make()\n") == []


def test_the_spec_answers_what_the_loop_and_launch_ask():
    hf, sg = engine_spec("hf"), engine_spec("sglang")
    gpu = load_config(
        "demo_cpu_sglang", ["rollout.sglang.device=cuda", "rollout.sglang.tp=2", "rollout.server_urls=[http://h:1]"]
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
