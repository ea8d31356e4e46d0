"""Weight sync into SGLang servers: the ``tensor``, ``distributed`` and ``disk`` transports (one code path per transport
for GPU and CPU; the device, the process-group backend and the tensor-sharing strategy are values of
``sglang_engine.PLATFORMS``).

* ``tensor``: each bucket flattened into one ``FlattenedTensorBucket`` and POSTed to /update_weights_from_tensor,
  serialized once PER RECEIVING TP RANK (a CUDA IPC handle is for one consumer: torch counts its references per
  share), CUDA IPC handles on GPU (same node), shared-memory files on a CPU. In a per-node sync each TP rank's
  serialization comes from the trainer rank on that TP rank's GPU (``gathering``; node_sync.py).
* ``distributed``: a process group {this process = rank 0, every server TP rank} (/init_weights_update_group); each
  bucket announced by /update_weights_from_distributed (``load_format="flattened_bucket"``) and broadcast as one
  flat tensor. If a server refuses the announcement the broadcast can never complete: the error is raised and the
  group abandoned instead of waiting forever.
* ``disk``: safetensors files in a directory + /update_weights_from_disk.

SGLang 0.5.23 refuses tensor and distributed updates outside a /begin_weight_update ... /end_weight_update session
(HTTP 400): both run inside one, closed even when an update fails. Updates are sent with ``flush_cache=False`` and
the radix cache is flushed once at the end (``/flush_cache?timeout=``, which waits for aborted requests to drain).
Every sync is verified against /weights_checker (``sglang_layout.ServerChecksums``). Each of these requests names its
sender in the query (``?poster=rank<RANK>.<node>``, ``poster_tag``): SGLang ignores the parameter and its access log
records it, so a server's own log says which rank of which node updated it (tests/slurm/test_colocated_sglang.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import datetime
import logging
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from megatron_dapo.engines.sglang import types as T
from megatron_dapo.engines.sglang.layout import ServerChecksums
from megatron_dapo.sync.weight_sync import WeightSync, write_safetensors_dir
from megatron_dapo.types import RolloutError, WeightSyncError

log = logging.getLogger(__name__)
FLUSH_TIMEOUT_S = 60.0  # /flush_cache waits this long for running (e.g. just aborted) requests to finish


def poster_tag(env: dict | None = None) -> str:
    """``rank<RANK>.<node>`` of this process (Slurm's node name, else the host name), URL-safe."""
    from urllib.parse import quote

    env = os.environ if env is None else env
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    return quote(f"rank{env.get('RANK', '0')}.{node}", safe="")


def with_poster(path: str, tag: str) -> str:
    return f"{path}{'&' if '?' in path else '?'}poster={tag}"


@runtime_checkable
class SGLangWorkers(Protocol):
    """What the SGLang transports need of an engine beyond ``RolloutEngine``: its workers' endpoints
    (``engines/sglang/client.py`` ``SGLangEngine``; it imports this module, so the check is by protocol)."""

    def call_workers(self, path: str, body: Any, servers: Any = None, timeout: float | None = None) -> list: ...


class SGLangSync(WeightSync):
    """The part every SGLang transport shares: requests to the workers, the session, the flush, verification."""

    def __init__(self, engine: Any, verify: str = "checksum", sample_size: int = 16, head_dim: int | None = None):
        if not isinstance(engine, SGLangWorkers):
            raise WeightSyncError(f"this weight sync transport needs an SGLang engine, not {type(engine).__name__}")
        super().__init__(engine, verify, sample_size)
        self.dtype = getattr(torch, engine.dtype)
        self.platform = engine.platform
        self.device = torch.device(self.platform.tensor_device)
        self.head_dim = head_dim
        self._record: ServerChecksums | None = None

    def _servers(self, workers: list | None) -> list:
        return list(workers) if workers is not None else list(self.engine.servers)

    def _post(self, servers: list, path: str, body: dict | list[dict], timeout: float | None = None) -> list:
        """POST to every server in parallel (``body`` one for all, or one per server); any failure, an HTTP error or
        ``success: false``, raises ``WeightSyncError`` naming the server and SGLang's message, after all answered."""
        from megatron_dapo.engines.sglang.server import http_call

        bodies = body if isinstance(body, list) else [body] * len(servers)
        timeout = timeout or self.engine.server_timeout
        tagged = with_poster(path, poster_tag())  # errors below name the plain path
        with cf.ThreadPoolExecutor(max_workers=max(1, len(servers))) as ex:
            futures = [ex.submit(http_call, s.url, tagged, b, timeout) for s, b in zip(servers, bodies)]
        answers, errors = [], []
        for s, fut in zip(servers, futures):
            try:
                answer = fut.result()
            except RolloutError as e:
                answer = None
                errors.append(f"{path} on {s.url} failed: {e}")
            if isinstance(answer, dict) and answer.get("success") is False:
                errors.append(f"{path} on {s.url} failed: {answer.get('message')}")
            answers.append(answer)
        if errors:
            raise WeightSyncError("; ".join(errors))
        return answers

    @contextlib.contextmanager
    def _session(self, servers: list) -> Iterator[None]:
        """/begin_weight_update ... /end_weight_update on every server; closed whatever happens inside."""
        try:
            self._post(servers, "/begin_weight_update", T.BeginWeightUpdateRequest().to_json())
        except WeightSyncError:
            self._end(servers, quiet=True)  # the servers that did open one
            raise
        try:
            yield
        except BaseException:
            self._end(servers, quiet=True)
            raise
        self._end(servers, quiet=False)

    def _end(self, servers: list, quiet: bool) -> None:
        try:
            self._post(servers, "/end_weight_update", T.EndWeightUpdateRequest().to_json())
        except WeightSyncError as e:
            if not quiet:
                raise
            log.warning("closing the weight-update session after a failure: %s", e)

    def _flush(self, servers: list) -> None:
        self._post(servers, f"/flush_cache?timeout={FLUSH_TIMEOUT_S:g}", {}, timeout=FLUSH_TIMEOUT_S + 30)

    # -- verification -------------------------------------------------------------------------------------------------

    def _expectation(self) -> ServerChecksums:
        self._record = ServerChecksums(self.dtype, self.device, self.engine.tp_size, self.head_dim)
        return self._record

    def _describe(self, key: Any) -> str:
        return self._record.describe(key) if self._record is not None else repr(key)

    def _observe(self, keys: list, workers: list | None) -> dict[str, dict]:
        servers = self._servers(workers)
        answers = self._post(servers, "/weights_checker", T.CheckWeightsRequest(action="checksum").to_json())
        out = {}
        for s, answer in zip(servers, answers):
            table = {}
            for rank in T.CheckWeightsResponse.from_json(answer).ranks:
                info = rank.role_info("target")
                if info:
                    tp_rank = int(info.get("tp_rank", 0))
                    table.update({(name, tp_rank): h for name, h in rank.checksums.items()})
            out[s.url] = table
        return out

    def _done(self, version: int, workers: list | None) -> None:
        if workers is None:
            self.engine.set_weight_version(version)

    def _on_device(self, bucket: list) -> list[tuple[str, torch.Tensor]]:
        return [(n, t.detach().to(self.device, self.dtype).contiguous()) for n, t in bucket]


class DiskSync(SGLangSync):
    """safetensors files in ``directory`` + /update_weights_from_disk on every worker (any placement)."""

    transport = "disk"

    def __init__(
        self,
        engine: Any,
        verify: str = "checksum",
        sample_size: int = 16,
        head_dim: int | None = None,
        directory: str | Path | None = None,
    ):
        super().__init__(engine, verify, sample_size, head_dim)
        self.directory = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="dapo_weights_"))

    def _send(self, buckets: Iterable[list], version: int, workers: list | None) -> None:
        servers = self._servers(workers)
        write_weights_dir(self.directory, buckets, self.dtype, servers)
        req = T.UpdateWeightsFromDiskRequest(
            model_path=str(self.directory), weight_version=str(version), flush_cache=False
        )
        self._post(servers, "/update_weights_from_disk", req.to_json())
        self._flush(servers)


def write_weights_dir(directory: Path, buckets: Iterable[list], dtype: torch.dtype, servers: list) -> None:
    """The weights as safetensors in ``directory``, with the config/tokenizer files of the servers' model directory
    beside them (loaders that read them); the disk transports of SGLang and vLLM."""
    write_safetensors_dir(directory, buckets, dtype)
    src = next((Path(s.model_path) for s in servers if s.model_path and Path(s.model_path).is_dir()), None)
    if src is not None:
        for f in src.iterdir():
            if f.is_file() and f.suffix in (".json", ".txt", ".model") and not f.name.endswith(".index.json"):
                shutil.copy2(f, directory / f.name)


def start_shm_manager_detached() -> None:
    """Start this process's ``torch_shm_manager`` now, with /dev/null as its stderr.

    torch starts the manager at the first "file_system" share (libshm ``start_manager``: fork, stdout -> a pipe to
    torch, exec) and it inherits our stderr. It lives until the last process that mapped a segment lets go, which is
    the attached SGLang server, so a ``dapo train | tee log`` whose server outlives it never saw EOF and hung. Once
    per process (torch keeps one manager socket per client); the fd is restored before returning.
    """
    global _SHM_MANAGER_STARTED
    if _SHM_MANAGER_STARTED:
        return
    saved = os.dup(2)
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 2)
            torch.zeros(1).share_memory_()  # the share that starts the manager (it stays up for later shares)
        finally:
            os.dup2(saved, 2)
            os.close(devnull)
    finally:
        os.close(saved)
    _SHM_MANAGER_STARTED = True


_SHM_MANAGER_STARTED = False


class TensorSync(SGLangSync):
    """/update_weights_from_tensor with flattened buckets: CUDA IPC handles on GPU, shared memory on a CPU."""

    transport = "tensor"

    def __init__(self, engine: Any, verify: str = "checksum", sample_size: int = 16, head_dim: int | None = None):
        super().__init__(engine, verify, sample_size, head_dim)
        if self.platform.sharing_strategy:  # see PLATFORMS: the server cannot rebuild fd-shared CPU storages
            torch.multiprocessing.set_sharing_strategy(self.platform.sharing_strategy)
            if self.platform.sharing_strategy == "file_system":
                start_shm_manager_detached()

    gather: Any = None  # node_sync.GpuGather while a per-node sync runs: TP rank i's handle from the rank on GPU i

    @contextlib.contextmanager
    def gathering(self, gather: Any) -> Iterator[None]:
        """Within: TP rank i of the (one) engine is sent the serialization that ``gather`` collects from the trainer
        rank on its GPU, not one made here (node_sync.py)."""
        self.gather = gather
        try:
            yield
        finally:
            self.gather = None

    def serialize(self, bucket: list) -> tuple[dict, str, str]:
        """(payload kept alive until the server has read it, SGLang's serialization of it, the bucket's key): one
        ``FlattenedTensorBucket`` on this process's device, serialized by SGLang's ``MultiprocessingSerializer``."""
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        if self.platform.patch_ipc_reductions:  # idempotent
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

            monkey_patch_torch_reductions()
        named = self._on_device(bucket)
        fb = FlattenedTensorBucket(named_tensors=named)
        payload = {"flattened_tensor": fb.get_flattened_tensor(), "metadata": fb.get_metadata()}
        torch.get_device_module(self.device).synchronize()
        return payload, MultiprocessingSerializer.serialize(payload, output_str=True), bucket_key(named)

    def _send(self, buckets: Iterable[list], version: int, workers: list | None) -> None:
        from sglang.srt.utils import MultiprocessingSerializer

        servers = self._servers(workers)
        gather = self.gather
        if gather is not None and (len(servers) != 1 or servers[0].tp_size != gather.size):
            raise WeightSyncError(f"per-GPU gather of {gather.size} ranks for {servers}: one engine of that TP size")
        with self._session(servers):
            for bucket in buckets:
                payload, blob, key = self.serialize(bucket)
                own = [blob]  # one serialization per receiving TP rank, never one blob shared
                if gather is not None:
                    own = gather.blobs(gather.collect((key, blob)), key)  # TP rank i <- the rank on GPU i
                bodies = []
                for s in servers:
                    blobs = [
                        own.pop(0) if own else MultiprocessingSerializer.serialize(payload, output_str=True)
                        for _ in range(s.tp_size)
                    ]
                    req = T.UpdateWeightsFromTensorRequest(
                        serialized_named_tensors=blobs,
                        load_format="flattened_bucket",
                        flush_cache=False,
                        weight_version=str(version),
                    )
                    bodies.append(req.to_json())
                self._post(servers, "/update_weights_from_tensor", bodies)
                del payload  # the servers have copied the data: the shares may go
        self._flush(servers)

    def send_as_peer(self, buckets: Iterable[list], gather: Any) -> str | None:
        """A trainer rank on GPU i of an engine whose poster is another rank: serialize each bucket here and hand
        it to the poster (``gather``), one collective per bucket whatever fails; the first error, or None."""
        error = None
        for bucket in buckets:
            keep, item = None, None
            if error is None:
                try:
                    keep, blob, key = self.serialize(bucket)
                    item = (key, blob)
                except Exception as e:  # noqa: BLE001 - reported to the poster and to every rank
                    error = f"rank {torch.distributed.get_rank()} serializing: {type(e).__name__}: {e}"
            gather.collect(item or error, keep=keep)
        return error


def bucket_key(named: list[tuple[str, torch.Tensor]]) -> str:
    """What must be equal in every rank's copy of a bucket: names, shapes, dtypes (a short digest)."""
    import hashlib

    return hashlib.sha1(repr([(n, tuple(t.shape), str(t.dtype)) for n, t in named]).encode()).hexdigest()[:16]


class DistributedSync(SGLangSync):
    """A process group {this process = rank 0, every server TP rank}; each bucket announced by HTTP and broadcast."""

    transport = "distributed"

    def __init__(
        self,
        engine: Any,
        verify: str = "checksum",
        sample_size: int = 16,
        head_dim: int | None = None,
        master_address: str | None = None,
        master_port: int | None = None,
        group_name: str = "dapo_weight_sync",
    ):
        super().__init__(engine, verify, sample_size, head_dim)
        self.backend = self.platform.group_backend
        self.master_address, self.master_port, self.group_name = master_address, master_port, group_name
        self._group = None
        self._members: list[str] = []
        self._name = ""
        engine.on_shutdown(self.close)

    def _ensure_group(self, servers: list) -> None:
        from megatron_dapo.actor.dist import free_port

        urls = [s.url for s in servers]
        if self._group is not None and urls == self._members:
            return
        self.close()
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")  # as SGLang's own tests: avoids NCCL broadcast failures
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        self._name = f"{self.group_name}_{uuid.uuid4().hex[:8]}"  # never reused: an abandoned group may linger
        addr = self.master_address or socket.gethostbyname(socket.gethostname())
        port = self.master_port or free_port("0.0.0.0")
        world = 1 + sum(s.tp_size for s in servers)
        bodies = [
            T.InitWeightsUpdateGroupRequest(
                addr, port, 1 + sum(x.tp_size for x in servers[:i]), world, group_name=self._name, backend=self.backend
            ).to_json()
            for i in range(len(servers))
        ]
        with cf.ThreadPoolExecutor(max_workers=1) as ex:  # the servers join while this process does
            joined = ex.submit(self._post, servers, "/init_weights_update_group", bodies)
            from sglang.srt.utils import init_custom_process_group

            self._group = init_custom_process_group(
                backend=self.backend,
                init_method=f"tcp://{addr}:{port}",
                world_size=world,
                rank=0,
                group_name=self._name,
                timeout=datetime.timedelta(seconds=self.engine.server_timeout),
            )
            joined.result()
        self._members = urls

    def close(self) -> None:
        """Tear the group down on the servers and here (a group with a dead member is abandoned). The engine calls it
        at shutdown: a group left to the end of the process would be destroyed with every other group by the next
        ``dist.destroy_process_group()``, which waits up to its timeout on a broadcast nobody joined."""
        import torch.distributed as dist

        if self._group is None:
            return
        alive = [s for s in self.engine.servers if s.url in self._members and s.healthy()]
        try:
            self._post(alive, "/destroy_weights_update_group", T.DestroyWeightsUpdateGroupRequest(self._name).to_json())
            dist.destroy_process_group(self._group)
        except Exception as e:  # noqa: BLE001 - nothing more to do than to start a new group next time
            log.warning("destroying weight-sync group %s: %s", self._name, e)
        self._group, self._members = None, []

    def _send(self, buckets: Iterable[list], version: int, workers: list | None) -> None:
        import torch.distributed as dist
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        servers = self._servers(workers)
        self._ensure_group(servers)
        with self._session(servers), cf.ThreadPoolExecutor(max_workers=1) as ex:
            for bucket in buckets:
                named = self._on_device(bucket)
                req = T.UpdateWeightsFromDistributedRequest(
                    names=[n for n, _ in named],
                    dtypes=[str(t.dtype).removeprefix("torch.") for _, t in named],
                    shapes=[list(t.shape) for _, t in named],
                    group_name=self._name,
                    flush_cache=False,
                    weight_version=str(version),
                    load_format="flattened_bucket",
                )
                flat = FlattenedTensorBucket(named_tensors=named).get_flattened_tensor()
                answer = ex.submit(self._post, servers, "/update_weights_from_distributed", req.to_json())
                work = dist.broadcast(flat, src=0, group=self._group, async_op=True)
                try:
                    answer.result()
                except WeightSyncError:  # a refused announcement: the servers will never join this broadcast
                    self.close()  # the servers leave the group: the pending broadcast fails instead of waiting
                    raise
                work.wait()
        self._flush(servers)


def sync_from_config(cfg: Any, engine: Any, kind: str) -> SGLangSync:
    """The transport ``kind`` (rollout.weight_sync: disk, tensor or distributed) into ``engine``'s servers, verified
    per ``rollout.verify_sync`` (engines/registry.py ``sync_factory``)."""
    from megatron_dapo.models.arch import load_arch
    from megatron_dapo.ports import JobPorts

    classes = {"disk": DiskSync, "tensor": TensorSync, "distributed": DistributedSync}
    if kind not in classes:
        raise ValueError(f"rollout.weight_sync = {kind!r}: SGLang takes {', '.join(classes)}")
    kwargs: dict[str, Any] = {"head_dim": load_arch(cfg.model.arch).head_dim}
    if kind == "disk":
        kwargs["directory"] = Path(cfg.train.run_dir) / cfg.train.name / "weight_sync"
    if kind == "distributed":
        job_ports = JobPorts.from_env()  # under dapo launch: the job's block; else a free port when the group forms
        kwargs["master_port"] = job_ports.weight_sync if job_ports else None
    return classes[kind](engine, cfg.rollout.verify_sync, **kwargs)
