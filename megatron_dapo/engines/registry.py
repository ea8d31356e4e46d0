"""The rollout engines, by ``rollout.engine``: what the config, the loop, launch and planning ask of an engine. Adding
an engine is one subpackage in ``engines/`` (a ``RolloutEngine``, see ``base.py``; its config block in an ``options``
module) and one entry here (docs/extending.md); no module outside ``engines/`` names an engine
(tests/unit/test_engine_registry.py). Config-level: this module and the options modules import config's typing only
(``config/run_config.py`` builds ``RolloutConfig`` from them; tests/unit/test_layering.py ``CONFIG_LEVEL``)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_dapo.config.plugins import load_callable
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.engines import hf_options
from megatron_dapo.engines.sglang import options as sglang_options
from megatron_dapo.engines.vllm import options as vllm_options

if TYPE_CHECKING:
    from megatron_dapo.engines.base import RolloutEngine
    from megatron_dapo.models.arch import ArchConfig
    from megatron_dapo.sync.weight_sync import WeightSync
    from megatron_dapo.types import TokenizerInfo


@dataclass(frozen=True)
class EngineSpec:
    """One engine's answers. Callables are ``"package.module:callable"`` strings, imported when first called (so that
    asking a spec never imports an engine's package)."""

    name: str
    # (cfg, arch, tokenizer_info, run_dir, model_path) -> engine
    factory: str
    starts_from_hf_dir: bool  # its servers load an HF checkpoint directory (the actor's weights are written first)
    weight_syncs: tuple[str, ...]  # the rollout.weight_sync transports it takes
    # server processes of their own (placed by dapo launch, started from this environment, asleep while the trainer
    # runs when colocated); False: the engine runs inside the trainer's process
    servers: bool = False
    package: str | None = None  # the Python package its servers import (rollout.fallback_hf, preflight)
    # (cfg) -> whether its servers can start here (their interpreter finds ``package``); None: this interpreter does
    installed_factory: str | None = None
    gpu_modules: tuple[tuple[str, str], ...] = ()  # (module, what) its GPU servers import: preflight checks them
    same_node_syncs: tuple[str, ...] = ()  # transports whose handles open on the sender's node only (per-node sync)
    tp_key: str = ""  # the config key of an engine's tensor-parallel size (its GPUs), for messages
    sync_factory: str | None = None  # (cfg, engine, kind) -> the WeightSync of each of its weight_syncs
    adapter_sync_factory: str | None = None  # (cfg, engine) -> LoRA adapter-only sync; None: merged weights only
    attach_factory: str | None = None  # (cfg, url) -> an engine attached to one running server, to sync it
    concurrency: str | None = None  # (cfg) -> requests in flight per server
    tp_of: str | None = None  # (cfg) -> GPUs per engine
    device_of: str | None = None  # (cfg) -> "cuda" | "cpu"
    # its config block, rollout.<name> (a dataclass), the rules it checks on a run that uses it (cfg, fail), and the
    # keys it had before the block (old dotted key -> new), named in the error a recipe using one gets
    options: type | None = None
    check: Callable[[Any, Callable[[str, Any, str], None]], None] | None = None
    moved_keys: Mapping[str, str] = field(default_factory=dict)
    # dapo launch: (cfg, python, port, colocated, host, args_file, base_gpu_id, nccl_port) -> a server's command line
    launch_command_factory: str | None = None
    launch_env_factory: str | None = None  # (cfg, colocated) -> the environment of a server task
    # the module of the servers' per-job API key: API_KEY_ENV (the variable the trainer gets it in), new_api_key(),
    # write_args_file(path, key) (the private file the servers read it from)
    auth_module: str | None = None
    # the planner's and the rehearsal's memory model of one engine rank: (arch, tp, gpu_bytes, mem_fraction) -> terms
    # (weights, kv_cache, kv_tokens, startup, rollout, rows(tp, phase)), and (arch, tp, gpu_bytes, startup_room,
    # rollout_room) -> the largest mem_fraction whose phases fit those rooms
    memory_factory: str | None = None
    fit_mem_fraction_factory: str | None = None

    def make(self, cfg: Any, arch: ArchConfig, info: TokenizerInfo, run_dir: Path, model_path) -> RolloutEngine:
        return self._call("factory", cfg, arch, info, run_dir, model_path)

    def _call(self, attr: str, *args):
        target = getattr(self, attr)
        if target is None:
            raise ConfigError(f"rollout.engine = {self.name!r} has no {attr}")
        return load_callable(target, f"rollout.engine {self.name!r} {attr}")(*args)

    def tp(self, cfg: Any) -> int:
        """GPUs (or CPU ranks) one engine spans; 1 for an in-process engine."""
        return int(self._call("tp_of", cfg)) if self.tp_of else 1

    def device(self, cfg: Any) -> str:
        return self._call("device_of", cfg) if self.device_of else ("cuda" if self.servers else "cpu")

    def on_gpus(self, cfg: Any) -> bool:
        """Its servers take GPUs of the job's nodes (placement, memory model, CUDA preflight)."""
        return self.servers and self.device(cfg) == "cuda"

    def weight_sync(self, cfg: Any, engine: Any, kind: str) -> WeightSync:
        return self._call("sync_factory", cfg, engine, kind)

    def adapter_sync(self, cfg: Any, engine: Any) -> WeightSync:
        return self._call("adapter_sync_factory", cfg, engine)

    def attach(self, cfg: Any, url: str) -> RolloutEngine:
        return self._call("attach_factory", cfg, url)

    def launch_command(self, cfg: Any, *args) -> list[str]:
        return self._call("launch_command_factory", cfg, *args)

    def launch_env(self, cfg: Any, colocated: bool) -> dict[str, str]:
        return self._call("launch_env_factory", cfg, colocated)

    def auth(self):
        """The servers' key module (``auth_module``), imported."""
        if self.auth_module is None:
            raise ConfigError(f"rollout.engine = {self.name!r} has no servers to authenticate to")
        return importlib.import_module(self.auth_module)

    def memory(self, arch: Any, tp: int, gpu_bytes: float, mem_fraction: float | None) -> Any:
        return self._call("memory_factory", arch, tp, gpu_bytes, mem_fraction)

    def fit_mem_fraction(self, arch: Any, tp: int, gpu_bytes: float, *rooms: float) -> float:
        return self._call("fit_mem_fraction_factory", arch, tp, gpu_bytes, *rooms)

    def installed(self, cfg: Any) -> bool:
        """Its servers' package is there (an in-process engine: always)."""
        if self.installed_factory:
            return bool(self._call("installed_factory", cfg))
        return self.package is None or importlib.util.find_spec(self.package) is not None

    def per_server_concurrency(self, cfg: Any) -> int:
        return int(self._call("concurrency", cfg)) if self.concurrency else 0


_SG = "megatron_dapo.engines.sglang"
_VL = "megatron_dapo.engines.vllm"
ENGINES: dict[str, EngineSpec] = {
    "hf": EngineSpec(
        "hf",
        "megatron_dapo.engines.hf:engine_from_config",
        False,
        ("copy",),
        sync_factory="megatron_dapo.sync.weight_sync:copy_sync_from_config",
        options=hf_options.HFOptions,
        check=hf_options.validate,
        moved_keys=hf_options.MOVED_KEYS,
    ),
    "sglang": EngineSpec(
        "sglang",
        f"{_SG}.client:engine_from_config",
        True,
        ("tensor", "distributed", "disk"),
        servers=True,
        package="sglang",
        gpu_modules=(("sglang", "SGLang"), ("sgl_kernel", "SGLang's CUDA kernels (sgl-kernel)")),
        same_node_syncs=("tensor",),
        tp_key="rollout.sglang.tp",
        sync_factory=f"{_SG}.sync:sync_from_config",
        adapter_sync_factory=f"{_SG}.adapter_sync:adapter_sync_from_config",
        attach_factory=f"{_SG}.client:attach_from_config",
        concurrency=f"{_SG}.capacity:per_server_concurrency",
        tp_of=f"{_SG}.server:tp_from_config",
        device_of=f"{_SG}.server:device_from_config",
        launch_command_factory=f"{_SG}.launch:launch_command",
        launch_env_factory=f"{_SG}.launch:launch_env",
        auth_module=f"{_SG}.auth",
        memory_factory=f"{_SG}.memory:sglang_arch_terms",
        fit_mem_fraction_factory=f"{_SG}.memory:fit_mem_fraction",
        options=sglang_options.SGLangOptions,
        check=sglang_options.validate,
        moved_keys=sglang_options.MOVED_KEYS,
    ),
    "vllm": EngineSpec(
        "vllm",
        f"{_VL}.client:engine_from_config",
        True,
        ("disk", "distributed"),
        servers=True,
        package="vllm",
        installed_factory=f"{_VL}.server:installed",
        gpu_modules=(("vllm", "vLLM"),),
        tp_key="rollout.vllm.tp",
        sync_factory=f"{_VL}.transports:sync_from_config",
        attach_factory=f"{_VL}.client:attach_from_config",
        concurrency=f"{_SG}.capacity:per_server_concurrency",
        tp_of=f"{_VL}.server:tp_from_config",
        device_of=f"{_VL}.server:device_from_config",
        launch_command_factory=f"{_VL}.launch:launch_command",
        launch_env_factory=f"{_VL}.launch:launch_env",
        auth_module=f"{_SG}.auth",
        memory_factory=f"{_VL}.memory:vllm_arch_terms",
        fit_mem_fraction_factory=f"{_VL}.memory:fit_mem_fraction",
        options=vllm_options.VLLMOptions,
        check=vllm_options.validate,
        moved_keys=vllm_options.MOVED_KEYS,
    ),
}


DEFAULT_ENGINE = "hf"  # rollout.engine's default, and what rollout.fallback_hf falls back to: in process, no servers
GPU_ENGINE = "sglang"  # the engine `dapo plan` sizes when it is given no config (PlanOptions.engine)


def engine_spec(name: str) -> EngineSpec:
    if name not in ENGINES:
        raise ConfigError(f"rollout.engine = {name!r}: unknown; known: {', '.join(ENGINES)}")
    return ENGINES[name]


def lora_adapter_sync(cfg: Any) -> bool:
    """The rollout engine applies the LoRA adapters itself (``rollout.lora_sync``): only the adapters are synced. An
    engine without an adapter sync takes the merged weights."""
    r = cfg.rollout
    has = engine_spec(r.engine).adapter_sync_factory is not None
    return cfg.model.lora.rank > 0 and has and r.lora_sync in ("auto", "adapter")
