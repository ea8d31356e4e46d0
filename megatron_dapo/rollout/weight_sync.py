"""Verified weight sync from the actor (HF-named full tensors, bucketed) to the rollout engine: ONE interface.

    weight_sync = make_weight_sync(cfg, engine)               # rollout.weight_sync: copy | cuda_ipc | nccl | disk
    report = weight_sync.sync(bridge.export(model), version)  # -> SyncReport(bytes, seconds, tensors, version, ...)

Transports: ``copy`` (in-process, HF engine), ``cuda_ipc`` (/update_weights_from_tensor with CUDA IPC handles,
colocated, same node), ``nccl`` (/init_weights_update_group + /update_weights_from_distributed and a broadcast from
this process), ``disk`` (safetensors in a directory + /update_weights_from_disk).

Verification (``rollout.verify_sync``: checksum | sample | off): while the buckets stream through, the sender
records a checksum of every tensor (float64 sum, position-weighted sum, and the sum of magnitudes, computed in the
receiver's dtype); after loading, the receiver's copy is read back and compared, and a difference raises
``WeightSyncError`` naming the tensor. The HF engine is read back in full. SGLang only exposes
/get_weights_by_name, which returns the first rows of a tensor (dim 0; the first elements of a 1-D tensor), so
for SGLang the checksums cover that prefix of each tensor, on every worker; "sample" checks ``sample_size`` tensors
per version instead of all: a window that moves over a fixed shuffle of the names, so consecutive versions check
different tensors and every tensor is checked once every ceil(N / sample_size) versions. A NaN/Inf in a sent tensor is an error too.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from megatron_dapo.rollout import sglang_types as T
from megatron_dapo.rollout.engine import Bucket, WeightSyncError

__all__ = [
    "Checksum",
    "CopySync",
    "CudaIpcSync",
    "DiskSync",
    "NcclSync",
    "SyncReport",
    "WeightSync",
    "WeightSyncError",
    "make_weight_sync",
    "tensor_checksum",
    "write_safetensors_dir",
]

PERIOD = 1021  # position weights 1..PERIOD (prime): a permutation or transpose changes the weighted sum
CHUNK_PERIODS = 128  # a chunk is CHUNK_PERIODS * PERIOD elements (1 MB of float64: cache-sized)
_WEIGHTS: dict[tuple[str, int], torch.Tensor] = {}  # (device, chunk) -> the position weights of one chunk


@dataclass(frozen=True)
class Checksum:
    shape: tuple[int, ...]
    total: float  # sum x
    weighted: float  # sum x_i * (1 + i mod PERIOD)
    magnitude: float  # sum |x| (the scale of the tolerance)

    @property
    def finite(self) -> bool:
        return all(map(_isfinite, (self.total, self.weighted)))

    def mismatch(self, other: Checksum | None, rtol: float = 1e-12) -> str | None:
        """None when equal (sums within ``rtol`` of their magnitude), else a description of the difference."""
        if other is None:
            return "the receiver returned no value"
        if self.shape != other.shape:
            return f"shape {other.shape} on the receiver, {self.shape} sent"
        for what, a, b, scale in (
            ("sum", self.total, other.total, max(self.magnitude, other.magnitude)),
            ("position-weighted sum", self.weighted, other.weighted, PERIOD * max(self.magnitude, other.magnitude)),
        ):
            if not abs(a - b) <= rtol * scale:
                return f"{what} {b!r} on the receiver, {a!r} sent"
        return None


def _isfinite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def tensor_checksum(t: torch.Tensor, dtype: torch.dtype | None = None) -> Checksum:
    """Checksum of ``t`` (cast to ``dtype`` first, as the receiver stores it), computed on t's device."""
    x = t.detach()
    if dtype is not None and x.dtype != dtype:
        x = x.to(dtype)
    flat = x.reshape(-1)
    chunk = CHUNK_PERIODS * PERIOD  # a multiple of PERIOD: every chunk has the same weights
    key = (str(flat.device), chunk)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = torch.arange(chunk, dtype=torch.float64, device=flat.device).remainder_(PERIOD).add_(1)
    weights = _WEIGHTS[key]
    acc = torch.zeros(3, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), chunk):
        c = flat[start : start + chunk].to(torch.float64)
        acc += torch.stack([c.sum(), c @ weights[: c.numel()], c.abs().sum()])
    total, weighted, magnitude = acc.tolist()
    return Checksum(tuple(t.shape), total, weighted, magnitude)


def sample_window(names: list[str], size: int, version: int) -> list[str]:
    """The ``size`` names that ``verify_sync = sample`` checks at ``version`` (see the module docstring)."""
    order = sorted(names)
    random.Random(0).shuffle(order)
    start = (int(version) * size) % len(order)
    return sorted((order + order)[start : start + size])


@dataclass
class SyncReport:
    version: int
    tensors: int
    bytes: int  # as sent (the sender's dtype)
    seconds: float  # transfer + load + verification
    verify_seconds: float
    verified: int  # tensors compared on the receiver (per worker)
    transport: str

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else float("inf")

    def metrics(self, prefix: str = "sync/") -> dict[str, float]:
        return {
            f"{prefix}seconds": self.seconds,
            f"{prefix}verify_seconds": self.verify_seconds,
            f"{prefix}gb": self.bytes / 1e9,
            f"{prefix}tensors": float(self.tensors),
            f"{prefix}version": float(self.version),
        }


class WeightSync(ABC):
    """Send HF-named buckets to an engine and verify what it loaded. Subclasses implement one transport."""

    transport: ClassVar[str]
    rtol: float = 1e-12

    def __init__(self, engine: Any, verify: str = "checksum", sample_size: int = 16):
        if verify not in ("checksum", "sample", "off"):
            raise ValueError(f"rollout.verify_sync = {verify!r}: expected checksum, sample or off")
        self.engine, self.verify_mode, self.sample_size = engine, verify, sample_size
        self.last_expected: dict[str, Checksum] = {}

    def sync(self, buckets: Iterable[Bucket], version: int, workers: list | None = None) -> SyncReport:
        """Send every bucket, load it on the receiver, verify; ``workers`` limits an SGLang sync to some servers."""
        t0 = time.perf_counter()
        expected: dict[str, Checksum] = {}
        stats = {"bytes": 0, "tensors": 0}

        def tapped() -> Iterator[list]:
            for bucket in buckets:
                bucket = list(bucket)
                for name, tensor in bucket:
                    stats["bytes"] += tensor.numel() * tensor.element_size()
                    stats["tensors"] += 1
                    if self.verify_mode != "off":
                        expected[name] = c = self._expect(name, tensor)
                        if not c.finite:
                            raise WeightSyncError(f"tensor {name!r}: NaN or Inf in the weights being sent (v{version})")
                yield bucket

        self._send(tapped(), int(version), workers)
        self.last_expected = expected  # the sender's checksums: ``verify(last_expected)`` re-checks later
        t1 = time.perf_counter()
        verified = self.verify(expected, int(version), workers) if self.verify_mode != "off" else 0
        self._done(int(version), workers)
        t2 = time.perf_counter()
        return SyncReport(int(version), stats["tensors"], stats["bytes"], t2 - t0, t2 - t1, verified, self.transport)

    def verify(self, expected: dict[str, Checksum], version: int = -1, workers: list | None = None) -> int:
        """Compare the receiver's tensors with the sender's checksums; raise naming the tensors that differ."""
        names = sorted(expected)
        if self.verify_mode == "sample" and len(names) > self.sample_size:
            names = sample_window(names, self.sample_size, version)
        bad = []
        for where, observed in self._observe(names, workers).items():
            for name in names:
                why = expected[name].mismatch(observed.get(name), self.rtol)
                if why is not None:
                    bad.append(f"tensor {name!r} on {where}: {why}")
        if bad:
            more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
            raise WeightSyncError(
                f"weight sync v{version} via {self.transport} failed verification: " + "; ".join(bad[:3]) + more
            )
        return len(names)

    @abstractmethod
    def _expect(self, name: str, tensor: torch.Tensor) -> Checksum: ...

    @abstractmethod
    def _send(self, buckets: Iterable[list], version: int, workers: list | None) -> None: ...

    @abstractmethod
    def _observe(self, names: list[str], workers: list | None) -> dict[str, dict[str, Checksum | None]]: ...

    def _done(self, version: int, workers: list | None) -> None:  # noqa: B027 - optional hook
        """After a verified sync (SGLang: record the engine's weight version)."""


# ----------------------------------------------------------------------------------------------------------------------
# In process (HF engine)


class CopySync(WeightSync):
    """In-process copy into an ``HFEngine`` (no serialization, no disk); verified against a full read-back."""

    transport = "copy"

    def __init__(self, engine: Any, verify: str = "checksum", sample_size: int = 16):
        if not hasattr(engine, "state_tensor"):
            raise WeightSyncError(
                f"rollout.weight_sync = copy needs the in-process hf engine, not {type(engine).__name__}"
            )
        super().__init__(engine, verify, sample_size)

    def _expect(self, name: str, tensor: torch.Tensor) -> Checksum:
        return tensor_checksum(tensor, dtype=self.engine.dtype)

    def _send(self, buckets: Iterable[list], version: int, workers: list | None) -> None:
        self.engine.update_weights(buckets, version)

    def _observe(self, names: list[str], workers: list | None) -> dict[str, dict[str, Checksum | None]]:
        return {"hf-engine": {n: tensor_checksum(self.engine.state_tensor(n)) for n in names}}


# ----------------------------------------------------------------------------------------------------------------------
# SGLang transports (the tensors' prefixes are verified through /get_weights_by_name)


class _SGLangSync(WeightSync):
    def __init__(self, engine: Any, verify: str = "checksum", sample_size: int = 16, verify_rows: int = 2):
        if not hasattr(engine, "call_workers"):
            raise WeightSyncError(f"this weight sync transport needs an SGLang engine, not {type(engine).__name__}")
        super().__init__(engine, verify, sample_size)
        self.verify_rows = verify_rows
        self.dtype = getattr(torch, engine.dtype)
        self._truncate: dict[str, int] = {}

    def _servers(self, workers: list | None) -> list:
        return list(workers) if workers is not None else list(self.engine.servers)

    def _expect(self, name: str, tensor: torch.Tensor) -> Checksum:
        k = self.verify_rows if tensor.dim() >= 2 else min(tensor.numel(), 1024)
        self._truncate[name] = k
        prefix = tensor.detach()[:k].to(self.dtype).to("cpu", torch.float32)  # what the server reports (float32)
        return tensor_checksum(prefix)

    def _observe(self, names: list[str], workers: list | None) -> dict[str, dict[str, Checksum | None]]:
        import concurrent.futures as cf

        from megatron_dapo.rollout.sglang_engine import http_call

        def read(url: str, name: str) -> Checksum | None:
            body = T.GetWeightsByNameRequest(name=name, truncate_size=self._truncate[name]).to_json()
            values = http_call(url, "/get_weights_by_name", body, timeout=self.engine.server_timeout)
            return None if values is None else tensor_checksum(torch.tensor(values, dtype=torch.float32))

        out = {}
        with cf.ThreadPoolExecutor(max_workers=16) as ex:
            for s in self._servers(workers):
                futures = {n: ex.submit(read, s.url, n) for n in names}
                out[s.url] = {n: f.result() for n, f in futures.items()}
        return out

    def _check(self, answers: list, servers: list, what: str) -> None:
        for s, answer in zip(servers, answers):
            resp = T.SuccessResponse.from_json(answer) if isinstance(answer, dict) else None
            if resp is None or not resp.success:
                raise WeightSyncError(f"{what} on {s.url} failed: {answer!r}")

    def _flush(self, servers: list) -> None:
        self.engine.call_workers("/flush_cache", None, servers)

    def _done(self, version: int, workers: list | None) -> None:
        if workers is None:
            self.engine.set_weight_version(version)


def write_safetensors_dir(directory: str | Path, buckets: Iterable[Bucket], dtype: torch.dtype | None = None) -> int:
    """Write buckets as ``model-00000.safetensors``, ... (old ones removed); returns the number of files."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("model-*.safetensors"):
        old.unlink()
    count = 0
    for i, bucket in enumerate(buckets):
        tensors, ptrs = {}, set()
        for name, t in bucket:
            t = t.detach().to("cpu", dtype or t.dtype).contiguous()
            if t.data_ptr() in ptrs:  # safetensors refuses shared storage (tied weights)
                t = t.clone()
            ptrs.add(t.data_ptr())
            tensors[name] = t
        save_file(tensors, str(directory / f"model-{i:05d}.safetensors"), metadata={"format": "pt"})
        count += 1
    return count


class DiskSync(_SGLangSync):
    """safetensors files in ``directory`` + /update_weights_from_disk on every worker (any placement)."""

    transport = "disk"

    def __init__(
        self, engine: Any, verify: str = "checksum", sample_size: int = 16, directory: str | Path | None = None
    ):
        super().__init__(engine, verify, sample_size)
        self.directory = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="dapo_weights_"))

    def _send(self, buckets: Iterable[list], version: int, workers: list | None) -> None:
        servers = self._servers(workers)
        write_safetensors_dir(self.directory, buckets, self.dtype)
        src = next((Path(s.model_path) for s in servers if s.model_path and Path(s.model_path).is_dir()), None)
        if src is not None:  # config/tokenizer files beside the weights, for loaders that read them
            for f in src.iterdir():
                if f.is_file() and f.suffix in (".json", ".txt", ".model") and not f.name.endswith(".index.json"):
                    shutil.copy2(f, self.directory / f.name)
        req = T.UpdateWeightsFromDiskRequest(model_path=str(self.directory), weight_version=str(version))
        self._check(self.engine.call_workers("/update_weights_from_disk", req.to_json(), servers), servers, "update")


class CudaIpcSync(_SGLangSync):
    """CUDA IPC handles of GPU tensors via /update_weights_from_tensor (colocated: servers on this node)."""

    transport = "cuda_ipc"

    def __init__(self, engine: Any, verify: str = "checksum", sample_size: int = 16, flattened: bool = True):
        super().__init__(engine, verify, sample_size)
        self.flattened = flattened

    def _send(self, buckets: Iterable[list], version: int, workers: list | None) -> None:
        from sglang.srt.utils import MultiprocessingSerializer  # GPU extra; imported only here

        try:
            from sglang.srt.patch_torch import monkey_patch_torch_reductions

            monkey_patch_torch_reductions()  # device UUIDs in the handles (servers see other CUDA_VISIBLE_DEVICES)
        except ImportError:
            pass
        servers = self._servers(workers)
        for bucket in buckets:
            named = [(n, t.detach().to("cuda", self.dtype).contiguous()) for n, t in bucket]
            payload: Any = named
            if self.flattened:
                from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

                fb = FlattenedTensorBucket(named_tensors=named)
                payload = {"flattened_tensor": fb.get_flattened_tensor(), "metadata": fb.get_metadata()}
            torch.cuda.synchronize()
            blob = MultiprocessingSerializer.serialize(payload, output_str=True)
            answers = []
            for s in servers:  # one payload per TP rank of each server
                req = T.UpdateWeightsFromTensorRequest(
                    serialized_named_tensors=[blob] * s.tp_size,
                    load_format="flattened_bucket" if self.flattened else None,
                    flush_cache=False,
                    weight_version=str(version),
                )
                answers += self.engine.call_workers("/update_weights_from_tensor", req.to_json(), [s])
            self._check(answers, servers, "update_weights_from_tensor")
            del named, payload  # the servers have copied the data: the IPC handles may go
        self._flush(servers)


class NcclSync(_SGLangSync):
    """A NCCL group {this process = rank 0, every server TP rank}; each bucket is announced by HTTP and broadcast."""

    transport = "nccl"

    def __init__(
        self,
        engine: Any,
        verify: str = "checksum",
        sample_size: int = 16,
        master_address: str | None = None,
        master_port: int | None = None,
        group_name: str = "dapo_weight_sync",
    ):
        super().__init__(engine, verify, sample_size)
        self.master_address, self.master_port, self.group_name = master_address, master_port, group_name
        self._group = None
        self._members: list[str] = []
        self._count = 0

    def _ensure_group(self, servers: list) -> str:
        import concurrent.futures as cf
        import socket

        from megatron_dapo.actor.dist import free_port

        urls = [s.url for s in servers]
        name = f"{self.group_name}_{self._count}"
        if self._group is not None and urls == self._members:
            return name
        self._destroy()
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")  # as SGLang's own tests: avoids broadcast failures
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        self._count += 1
        name = f"{self.group_name}_{self._count}"
        addr = self.master_address or socket.gethostbyname(socket.gethostname())
        port = self.master_port or free_port("0.0.0.0")
        world = 1 + sum(s.tp_size for s in servers)
        offsets = [1 + sum(s.tp_size for s in servers[:i]) for i in range(len(servers))]
        with cf.ThreadPoolExecutor(max_workers=len(servers)) as ex:
            futures = [
                ex.submit(
                    self.engine.call_workers,
                    "/init_weights_update_group",
                    T.InitWeightsUpdateGroupRequest(addr, port, off, world, group_name=name).to_json(),
                    [s],
                )
                for s, off in zip(servers, offsets)
            ]
            from sglang.srt.utils import init_custom_process_group  # GPU extra; imported only here

            self._group = init_custom_process_group(
                backend="nccl", init_method=f"tcp://{addr}:{port}", world_size=world, rank=0, group_name=name
            )
            self._check([f.result()[0] for f in futures], servers, "init_weights_update_group")
        self._members = urls
        return name

    def _destroy(self) -> None:
        if self._group is None:
            return
        import torch.distributed as dist

        name = f"{self.group_name}_{self._count}"
        alive = [s for s in self.engine.servers if s.url in self._members and s.healthy()]
        try:
            self.engine.call_workers(
                "/destroy_weights_update_group", T.DestroyWeightsUpdateGroupRequest(name).to_json(), alive
            )
            dist.destroy_process_group(self._group)
        except Exception as e:  # a group with a dead member cannot be torn down cleanly; it is abandoned
            import logging

            logging.getLogger(__name__).warning("destroying NCCL group %s: %s", name, e)
        self._group, self._members = None, []

    def _send(self, buckets: Iterable[list], version: int, workers: list | None) -> None:
        import concurrent.futures as cf

        import torch.distributed as dist

        servers = self._servers(workers)
        name = self._ensure_group(servers)
        for bucket in buckets:
            named = [(n, t.detach().to("cuda", self.dtype).contiguous()) for n, t in bucket]
            req = T.UpdateWeightsFromDistributedRequest(
                names=[n for n, _ in named],
                dtypes=[str(t.dtype).removeprefix("torch.") for _, t in named],
                shapes=[list(t.shape) for _, t in named],
                group_name=name,
                flush_cache=False,
                weight_version=str(version),
            )
            with cf.ThreadPoolExecutor(max_workers=1) as ex:
                answer = ex.submit(self.engine.call_workers, "/update_weights_from_distributed", req.to_json(), servers)
                for _, t in named:
                    dist.broadcast(t, src=0, group=self._group)
                self._check(answer.result(), servers, "update_weights_from_distributed")
        self._flush(servers)


# ----------------------------------------------------------------------------------------------------------------------


def make_weight_sync(cfg: Any, engine: Any) -> WeightSync:
    """The transport named by ``cfg.rollout.weight_sync`` for ``engine``, verifying per ``rollout.verify_sync``."""
    r = cfg.rollout
    kind, verify = r.weight_sync, r.verify_sync
    if kind == "copy":
        return CopySync(engine, verify)
    if kind == "disk":
        return DiskSync(engine, verify, directory=Path(cfg.train.run_dir) / cfg.train.name / "weight_sync")
    if kind == "cuda_ipc":
        return CudaIpcSync(engine, verify)
    if kind == "nccl":
        from megatron_dapo.ports import JobPorts

        job_ports = JobPorts.from_env()  # under dapo launch: the job's block; else a free port when the group forms
        return NcclSync(engine, verify, master_port=job_ports.weight_sync if job_ports else None)
    from megatron_dapo.config import ConfigError

    raise ConfigError(f"rollout.weight_sync = {kind!r}: expected copy, cuda_ipc, nccl or disk")
