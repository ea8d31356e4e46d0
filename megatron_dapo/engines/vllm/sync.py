"""Weight sync into vLLM servers: the ``disk`` transport, verified tensor by tensor.

    pause (wait for what runs, clear the prefix cache) -> safetensors in a directory -> reload_weights -> verify ->
    weight version -> resume                                           (resumed whatever fails on the way)

* ``POST /pause?mode=wait&clear_cache=true`` (vllm 0.32.0 entrypoints/serve/rl/online/api_router.py:31-72; the
  clear is its default, given explicitly): no
  request is scheduled until /resume, and the prefix cache is emptied (v1/engine/core.py:898-919). Without the
  clear, the KV blocks of every prompt seen before the sync would be reused after it, computed with the old weights:
  ``reload_weights`` does not touch the prefix cache (v1/worker/gpu_model_runner.py:5287-5304).
* ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` on every worker
  (v1/worker/gpu_worker.py:629-631 -> model_executor/model_loader/reload/inplace.py:32-112): the checkpoint in DIR
  is read through the model's own ``load_weights`` (fusing q/k/v and gate/up) in place, the CPU's packed linears
  rebuilt (``process_weights_after_loading``), without a restart.
* Verification while still paused: ``dapo_checksums`` of the worker extension (``worker_ext.py``), compared with
  ``ServerChecksums`` (vLLM fuses, shards and pads as SGLang does; engines/sglang/layout.py).
* ``POST /update_weight_version`` (api_router.py:214-220) records the version the server reports.

A server put to sleep (colocated GPUs: ``VLLMEngine.sleep``) is already paused: it is neither paused nor resumed
here (its scheduling resumes when all its memory is awake). On GPUs ``rollout.weight_sync=distributed`` is vLLM's
NCCL weight transfer (``nccl_sync.py``) with the same pause and verification; CUDA IPC (same node) is not wired up.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.engines.sglang.layout import ServerChecksums
from megatron_dapo.engines.sglang.server import http_call
from megatron_dapo.engines.sglang.sync import write_weights_dir
from megatron_dapo.sync.weight_sync import SyncReport, WeightSync
from megatron_dapo.types import Bucket, RolloutError, WeightSyncError

log = logging.getLogger(__name__)


class VLLMDiskSync(WeightSync):
    """safetensors files in ``directory`` + ``reload_weights`` on every worker, inside a pause."""

    transport = "disk"
    PAUSE = "/pause?mode=wait&clear_cache=true"

    def __init__(
        self,
        engine: Any,
        verify: str = "checksum",
        sample_size: int = 16,
        head_dim: int | None = None,
        directory: str | Path | None = None,
    ):
        if not hasattr(engine, "asleep"):
            raise WeightSyncError(f"this weight sync transport needs a vLLM engine, not {type(engine).__name__}")
        super().__init__(engine, verify, sample_size)
        self.dtype = getattr(torch, engine.dtype)
        self.head_dim = head_dim
        self.directory = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="dapo_weights_"))
        self._record: ServerChecksums | None = None

    def _servers(self, workers: list | None) -> list:
        return list(workers) if workers is not None else list(self.engine.servers)

    def _post(self, servers: list, path: str, body: dict, quiet: bool = False) -> list:
        """The same call on every server in parallel; failures (HTTP errors, no answer) raise ``WeightSyncError``
        naming the server, after all answered (``quiet``: logged instead)."""
        timeout = self.engine.server_timeout
        with cf.ThreadPoolExecutor(max_workers=max(1, len(servers))) as ex:
            futures = [ex.submit(http_call, s.url, path, body, timeout) for s in servers]
        answers, errors = [], []
        for s, fut in zip(servers, futures):
            try:
                answers.append(fut.result())
            except RolloutError as e:
                answers.append(None)
                errors.append(f"{path.split('?')[0]} on {s.url} failed: {e}")
        if errors and quiet:
            log.warning("; ".join(errors))
        elif errors:
            raise WeightSyncError("; ".join(errors))
        return answers

    def sync(self, buckets: Iterable[Bucket], version: int, workers: list | None = None) -> SyncReport:
        awake = [s for s in self._servers(workers) if not self.engine.asleep(s.url)]
        self._post(awake, self.PAUSE, {})
        try:
            return super().sync(buckets, version, workers)
        finally:
            self._post(awake, "/resume", {}, quiet=True)

    def _send(self, buckets: Iterable[list], version: int, workers: list | None) -> None:
        servers = self._servers(workers)
        write_weights_dir(self.directory, buckets, self.dtype, servers)
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(self.directory)}}
        self._post(servers, "/collective_rpc", body)

    # -- verification -------------------------------------------------------------------------------------------------

    def _expectation(self) -> ServerChecksums:
        self._record = ServerChecksums(self.dtype, "cpu", self.engine.tp_size, self.head_dim)
        return self._record

    def _describe(self, key: Any) -> str:
        return self._record.describe(key) if self._record is not None else repr(key)

    def _observe(self, keys: list, workers: list | None) -> dict[str, dict]:
        servers = self._servers(workers)
        names = None if self.verify_mode == "checksum" else sorted({name for name, _ in keys})
        answers = self._post(servers, "/collective_rpc", {"method": "dapo_checksums", "kwargs": {"names": names}})
        out = {}
        for s, answer in zip(servers, answers):
            table = {}
            for rank in (answer or {}).get("results") or []:
                if not isinstance(rank, dict):
                    raise WeightSyncError(f"{s.url}: dapo_checksums answered {str(rank)[:200]!r}: is the server "
                                          "started with --worker-extension-cls (engines/vllm/server.py)?")  # fmt: skip
                table.update({(name, int(rank["tp_rank"])): h for name, h in rank["checksums"].items()})
            out[s.url] = table
        return out

    def _done(self, version: int, workers: list | None) -> None:
        self._post(self._servers(workers), "/update_weight_version", {"new_version": str(version)})
        if workers is None:
            self.engine.set_weight_version(version)
