"""Verified weight sync from the actor (HF-named full tensors, bucketed) to the rollout engine: ONE interface.

    weight_sync = make_weight_sync(cfg, engine)               # loop/rollout.py; rollout.weight_sync: copy | tensor | distributed | disk
    report = weight_sync.sync(bridge.export(model), version)  # -> SyncReport(bytes, seconds, tensors, version, ...)

Transports: ``copy`` (in-process, HF engine; here) and, for SGLang servers (``sglang_sync.py``), ``tensor``
(/update_weights_from_tensor: CUDA IPC handles on GPU, shared memory on a CPU), ``distributed``
(/init_weights_update_group + /update_weights_from_distributed and a broadcast from this process: NCCL on GPU, gloo
on a CPU) and ``disk`` (safetensors in a directory + /update_weights_from_disk).

Verification (``rollout.verify_sync``: checksum | sample | off): while the buckets stream through, the sender records
what the receiver must hold (``_expectation``) and refuses NaN/Inf; after loading, the receiver is read back
(``_observe``) and a difference raises ``WeightSyncError`` naming the tensor. The HF engine is compared with float
checksums (sum, position-weighted sum) of every tensor; an SGLang server with the per-parameter hashes of its
/weights_checker, rebuilt on the sender from the sent tensors (``sglang_layout.py``). "sample" compares
``sample_size`` tensors per version instead of all: a window that moves over a fixed shuffle of the names, so
consecutive versions check different tensors and every tensor is checked once every ceil(N / sample_size) versions.
"""

from __future__ import annotations

import random
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from megatron_dapo.types import Bucket, WeightSyncError

__all__ = [
    "Checksum",
    "CopySync",
    "SyncReport",
    "WeightSync",
    "WeightSyncError",
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


def sample_window(names: list, size: int, version: int) -> list:
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

    def __init__(self, engine: Any, verify: str = "checksum", sample_size: int = 16):
        if verify not in ("checksum", "sample", "off"):
            raise ValueError(f"rollout.verify_sync = {verify!r}: expected checksum, sample or off")
        self.engine, self.verify_mode, self.sample_size = engine, verify, sample_size
        self.last_expected: dict = {}

    def sync(self, buckets: Iterable[Bucket], version: int, workers: list | None = None) -> SyncReport:
        """Send every bucket, load it on the receiver, verify; ``workers`` limits an SGLang sync to some servers."""
        t0 = time.perf_counter()
        expectation = self._expectation() if self.verify_mode != "off" else None
        stats = {"bytes": 0, "tensors": 0}

        def tapped() -> Iterator[list]:
            for bucket in buckets:
                bucket = list(bucket)
                for name, tensor in bucket:
                    stats["bytes"] += tensor.numel() * tensor.element_size()
                    stats["tensors"] += 1
                    if expectation is not None:
                        if not bool(torch.isfinite(tensor).all()):
                            raise WeightSyncError(f"tensor {name!r}: NaN or Inf in the weights being sent (v{version})")
                        expectation.add(name, tensor)
                yield bucket

        self._send(tapped(), int(version), workers)
        t1 = time.perf_counter()
        verified = 0
        if expectation is not None:
            self.last_expected = expectation.result()  # the sender's record: ``verify(last_expected)`` re-checks
            verified = self.verify(self.last_expected, int(version), workers)
        self._done(int(version), workers)
        t2 = time.perf_counter()
        return SyncReport(int(version), stats["tensors"], stats["bytes"], t2 - t0, t2 - t1, verified, self.transport)

    def verify(self, expected: dict, version: int = -1, workers: list | None = None) -> int:
        """Compare the receiver with the sender's record; raise naming the tensors that differ."""
        keys = sorted(expected)
        if self.verify_mode == "sample" and len(keys) > self.sample_size:
            keys = sample_window(keys, self.sample_size, version)
        bad = []
        for where, observed in self._observe(keys, workers).items():
            for key in keys:
                why = _mismatch(expected[key], observed.get(key))
                if why is not None:
                    bad.append(f"tensor {self._describe(key)} on {where}: {why}")
            if self.verify_mode == "checksum":  # a parameter nobody sent keeps stale values
                for key in sorted(set(observed) - set(expected)):
                    bad.append(f"tensor {self._describe(key)} on {where}: held by the receiver but not sent")
        if bad:
            more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
            raise WeightSyncError(
                f"weight sync v{version} via {self.transport} failed verification: " + "; ".join(bad[:3]) + more
            )
        return len(keys)

    @abstractmethod
    def _expectation(self) -> Any:
        """A fresh recorder: ``add(name, tensor)`` for every sent tensor, then ``result() -> {key: fingerprint}``."""

    @abstractmethod
    def _send(self, buckets: Iterable[list], version: int, workers: list | None) -> None: ...

    @abstractmethod
    def _observe(self, keys: list, workers: list | None) -> dict[str, dict]:
        """``{receiver: {key: fingerprint}}`` read back from each receiver (at least ``keys``)."""

    def _describe(self, key: Any) -> str:
        return repr(key)

    def _done(self, version: int, workers: list | None) -> None:  # noqa: B027 - optional hook
        """After a verified sync (SGLang: record the engine's weight version)."""


def _mismatch(sent: Any, seen: Any) -> str | None:
    if isinstance(sent, Checksum):
        return sent.mismatch(seen)
    if seen is None:
        return "the receiver has no such parameter"
    return None if seen == sent else f"checksum {seen} on the receiver, {sent} sent"


# ----------------------------------------------------------------------------------------------------------------------
# In process (HF engine)


class CopySync(WeightSync):
    """In-process copy into an ``HFEngine`` (no serialization, no disk); verified against a full read-back."""

    transport = "copy"

    def __init__(self, engine: Any, verify: str = "checksum", sample_size: int = 16):
        if not callable(getattr(engine, "state_tensor", None)):  # the read-back that verifies the copy
            raise WeightSyncError(
                f"rollout.weight_sync = copy needs an in-process engine (one with state_tensor), not "
                f"{type(engine).__name__}"
            )
        super().__init__(engine, verify, sample_size)

    def _expectation(self) -> _Checksums:
        return _Checksums(self.engine.dtype)

    def _send(self, buckets: Iterable[list], version: int, workers: list | None) -> None:
        self.engine.update_weights(buckets, version)

    def _observe(self, keys: list, workers: list | None) -> dict[str, dict[str, Checksum | None]]:
        return {"hf-engine": {n: tensor_checksum(self.engine.state_tensor(n)) for n in keys}}


class _Checksums:
    """Float checksums of every sent tensor, computed in the receiver's dtype."""

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.checksums = dtype, {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.checksums[name] = tensor_checksum(tensor, dtype=self.dtype)

    def result(self) -> dict[str, Checksum]:
        return self.checksums


# ----------------------------------------------------------------------------------------------------------------------


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


def copy_sync_from_config(cfg: Any, engine: Any, kind: str) -> CopySync:
    """``rollout.weight_sync: copy`` (engines/registry.py ``sync_factory`` of the in-process engine)."""
    return CopySync(engine, cfg.rollout.verify_sync)
