"""LoRA adapter-only weight sync into SGLang servers (``rollout.lora_sync``, ``engines.registry.lora_adapter_sync``).

The servers start from the frozen base (``RolloutDriver``: the HF export unmerged) with ``--enable-lora``
(``server.lora_server_args``); the base never changes. Each sync sends only the adapters, megabytes instead of the
model: they are written as a PEFT folder ``<directory>/dapo-v<version>.<n>`` (``bridge/peft.py``, the names and
fused-layer splits PEFT and SGLang read; n counts the syncs) and every server loads it under that name
(``/load_lora_adapter``). From
then on the engine's requests name that adapter (``SGLangEngine.lora_name``); the previous version is unloaded after
the switch (SGLang's unload waits for requests still running with it, so the new one is loaded first) and its folder
removed. The folders live in the run directory: servers on other nodes read them there (a shared filesystem, as the
run's checkpoints need).

Verified: every server must list the new adapter as loaded from that folder, and the folder's tensors must carry the
checksums of what the actor exported (``WeightSync.verify``). That the served logprobs equal the actor's, version
after version, is a test (``tests/sglang/test_lora_sglang.py``), not a per-sync check.

SGLang 0.5.23 routes: ``/load_lora_adapter`` ``LoadLoRAAdapterReqInput {lora_name, lora_path, pinned}`` and
``/unload_lora_adapter`` ``UnloadLoRAAdapterReqInput {lora_name}`` (sglang/srt/managers/io_struct.py), both answering
``LoRAUpdateOutput {success, error_message, loaded_adapters}``; ``/generate`` takes ``lora_path`` = the adapter's name.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.engines.sglang import types as T
from megatron_dapo.engines.sglang.sync import SGLangSync
from megatron_dapo.sync.weight_sync import _Checksums, tensor_checksum
from megatron_dapo.types import WeightSyncError

ADAPTER_FILE = "adapter_model.safetensors"


class AdapterSync(SGLangSync):
    """Adapters only: a PEFT folder per sync, loaded by every server, the engine switched to it, the old unloaded.

    Each sync gets a new name, ``dapo-v<version>.<n>`` (the warm start syncs version 0 more than once, each time with
    other weights); a resync of restarted servers loads the current one."""

    transport = "adapter"

    def __init__(self, engine: Any, peft_config: dict, directory: str | Path, verify: str = "checksum",
                 sample_size: int = 16):  # fmt: skip
        super().__init__(engine, verify, sample_size)
        self.peft_config = peft_config
        self.directory = Path(directory)
        self.syncs = 0
        self.current: str | None = None  # the adapter the engine's requests name
        self.loaded: dict[str, str] = {}  # server URL -> the adapter it serves
        self.answers: dict[str, dict] = {}  # server URL -> its loaded adapters, as its last load answered
        self._sending = ""  # the adapter of the sync in progress

    def folder(self, name: str) -> Path:
        return self.directory / name

    def _send(self, buckets: Iterable[list], version: int, workers: list | None) -> None:
        from megatron_dapo.bridge.peft import write_peft_folder

        tensors = {name: t for bucket in buckets for name, t in bucket}
        if not tensors:
            raise WeightSyncError(f"adapter sync v{version}: no adapter tensors to send (is model.lora.rank > 0?)")
        if workers is None or self.current is None:
            self.syncs += 1
            self._sending = f"dapo-v{int(version)}.{self.syncs}"
            write_peft_folder(tensors, self.peft_config, self.folder(self._sending))
        else:  # restarted servers: the adapter the others serve
            self._sending = self.current
        servers = self._servers(workers)
        request = T.LoadLoRAAdapterRequest(self._sending, str(self.folder(self._sending)))
        for server, answer in zip(servers, self._post(servers, "/load_lora_adapter", request.to_json())):
            reply = T.LoRAUpdateResponse.from_json(answer if isinstance(answer, dict) else {"success": False})
            if not reply.success:
                raise WeightSyncError(f"/load_lora_adapter {self._sending} on {server.url} failed: "
                                      f"{reply.error_message}")  # fmt: skip
            self.answers[server.url] = reply.loaded_adapters or {}

    def _done(self, version: int, workers: list | None) -> None:
        """The engine's requests now name the new adapter; the old one is unloaded and its folder removed."""
        name = self._sending
        if workers is None:
            self.engine.lora_name = self.current = name
            self.engine.set_weight_version(version)
        for server in self._servers(workers):
            old, self.loaded[server.url] = self.loaded.get(server.url), name
            if old and old != name:  # (SGLang's unload waits for the requests still running with it)
                self._post([server], "/unload_lora_adapter", T.UnloadLoRAAdapterRequest(old).to_json())
        if self.directory.is_dir():
            live = set(self.loaded.values()) | {name}
            for folder in self.directory.iterdir():
                if folder.is_dir() and folder.name.startswith("dapo-v") and folder.name not in live:
                    shutil.rmtree(folder, ignore_errors=True)

    # -- verification: each server lists the adapter from its folder, whose tensors are what the actor exported -----

    def _expectation(self) -> _HostChecksums:
        return _HostChecksums(None)

    def _observe(self, keys: list, workers: list | None) -> dict[str, dict]:
        from safetensors.torch import load_file

        out = {}
        for server in self._servers(workers):
            ref = self.answers.get(server.url, {}).get(self._sending)
            path = ref if isinstance(ref, str) else (ref or {}).get("lora_path")
            file = Path(path, ADAPTER_FILE) if path else None
            loaded = load_file(str(file)) if file is not None and file.is_file() else {}
            out[server.url] = {k: tensor_checksum(t) for k, t in loaded.items()}
        return out


class _HostChecksums(_Checksums):
    """The sent tensors' checksums as ``_observe`` computes them from the folder: on the host, in their own dtype."""

    def add(self, name: str, tensor: torch.Tensor) -> None:
        super().add(name, tensor.detach().cpu())


def adapter_sync_from_config(cfg: Any, engine: Any) -> AdapterSync:
    """The LoRA adapter-only sync of a run (engines/registry.py ``adapter_sync_factory``): PEFT folders under the
    run's ``lora_adapters/``, verified per ``rollout.verify_sync``."""
    from megatron_dapo.bridge.peft import peft_config
    from megatron_dapo.models.arch import load_arch

    folder = Path(cfg.train.run_dir) / cfg.train.name / "lora_adapters"
    return AdapterSync(engine, peft_config(load_arch(cfg.model.arch), cfg.model.lora), folder, cfg.rollout.verify_sync)
