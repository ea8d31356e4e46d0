"""Streaming checkpoint conversion: HF safetensors ⇄ megatron-core ``dist_checkpointing`` (model only).

HF → Megatron (``hf_to_megatron``): the checkpoint holds GLOBAL tensors under the keys ``GPTModel.sharded_state_dict()``
uses (layers stacked along a leading axis, the embedding at the real vocabulary: megatron zero-pads the rows on load);
``dist_checkpointing`` reshards on load, so the actor loads it at any TP/PP. One process writes it, one HF shard at a
time: each HF shard is read (plain reads, no mmap), cut into checkpoint pieces (the fused QKV as head blocks, fc1 as
``[gate; up]`` halves — views of the HF tensors, never whole fused tensors), saved with ``dist_checkpointing.save`` into
a part directory, and freed; the parts' torch-DCP metadata are merged at the end. Peak memory ≈ one HF shard.

Megatron → HF (``convert_to_hf.megatron_to_hf``): layers are loaded a bucket at a time and written into safetensors
shards of at most ``max_shard_size``, with ``model.safetensors.index.json``, ``config.json`` and the template's tokenizer
files. LoRA adapters, both ways: ``convert_lora.py``.

Layout of a converted checkpoint directory (what ``MegatronActor.load(dir, load_optimizer=False)`` reads)::

    metadata.json, common.pt, .metadata, __<part>_<n>.distcp   megatron-core torch_dist checkpoint
    dapo_meta.json   {"format": "megatron-dapo/1", "arch": {ArchConfig fields}, "vocab_size": V, "dtype": "bf16",
                      "kind": "model", "tp": N, "pp": M, "source": ...}   (same file/format as actor/checkpoint.py)

Both directions validate everything before writing (config vs model config, missing / unexpected / wrongly shaped
tensors, a non-empty output directory) and write into a temporary directory next to the output, renamed at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import re
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_dapo.actor.checkpoint import FORMAT, META_FILE, use_forked_results_queue
from megatron_dapo.bridge.reshard import check_divisible
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import ArchConfig, compare_arch, load_arch
from megatron_dapo.models.hf_config import arch_from_hf, read_hf_config
from megatron_dapo.models.mapping import checkpoint_axes
from megatron_dapo.models.registry import table_for

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
HF_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
TEMPLATE_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt|"
    r"generation_config\.json|chat_template.*|.*\.tiktoken|.*\.model)$"
)


# ----------------------------------------------------------------------------------------------------------------------
# Metadata file


def write_meta(ckpt_dir: str | Path, arch: ArchConfig, dtype: str, **extra) -> None:
    """Write ``dapo_meta.json`` (TP/PP-independent facts a checkpoint needs to be read without a run config)."""
    meta = {"format": FORMAT, "arch": dataclasses.asdict(arch), "vocab_size": arch.vocab_size, "dtype": dtype, **extra}
    Path(ckpt_dir, META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def read_meta(ckpt_dir: str | Path) -> tuple[ArchConfig, dict]:
    path = Path(ckpt_dir, META_FILE)
    if not path.is_file():
        raise ConfigError(f"{ckpt_dir}: no {META_FILE} (not a megatron-dapo checkpoint; give --hf-template)")
    try:
        meta = json.loads(path.read_text())
        if meta.get("format") != FORMAT:
            raise ConfigError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        return ArchConfig(**meta["arch"]), meta
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: unreadable ({e})") from e


# ----------------------------------------------------------------------------------------------------------------------
# Safetensors without mmap: headers for validation, plain reads for data (memory = what we hold, nothing else)

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclasses.dataclass
class StEntry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_st_header(path: Path) -> dict[str, StEntry]:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise ValueError("header too large")
            header = json.loads(f.read(n))
        out = {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            a, b = e["data_offsets"]
            if e["dtype"] not in _ST_DTYPES:
                raise ConfigError(f"{path}: tensor {name}: unsupported dtype {e['dtype']}")
            out[name] = StEntry(path, _ST_DTYPES[e["dtype"]], tuple(e["shape"]), 8 + n + a, b - a)
        return out
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise ConfigError(f"{path}: not a readable safetensors file ({e})") from e


def read_st_tensor(entry: StEntry, fh=None) -> torch.Tensor:
    buf = torch.empty(entry.nbytes, dtype=torch.uint8)
    with contextlib.ExitStack() as stack:
        f = fh or stack.enter_context(open(entry.file, "rb"))
        f.seek(entry.start)
        if f.readinto(memoryview(buf.numpy())) != entry.nbytes:
            raise ConfigError(f"{entry.file}: truncated tensor data")
    return buf.view(entry.dtype).reshape(entry.shape)


def hf_weight_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ConfigError(f"{index}: unreadable ({e})") from e
        missing = [f for f in files if not (hf_dir / f).is_file()]
        if missing:
            raise ConfigError(f"{index}: shard file {missing[0]} does not exist")
        return [hf_dir / f for f in files]
    single = hf_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ConfigError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")


def _listing(kind: str, names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")
    return f"{kind} {shown}"


def _check_tensors(source: str, present: dict[str, tuple], expected: dict[str, tuple], ignorable) -> None:
    """One error listing missing, unexpected and wrongly shaped tensors by name."""
    problems = []
    missing = [n for n in expected if n not in present]
    unexpected = [n for n in present if n not in expected and not ignorable(n)]
    shaped = [
        f"{n} {list(present[n])} (expected {list(expected[n])})"
        for n in expected
        if n in present and tuple(present[n]) != tuple(expected[n])
    ]
    if missing:
        problems.append(_listing("missing tensors:", missing))
    if unexpected:
        problems.append(_listing("unexpected tensors:", unexpected))
    if shaped:
        problems.append(_listing("wrong shape:", shaped))
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------------------------------
# Output directory handling


def check_output_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out}: output exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"{out}: output directory is not empty (pass --overwrite to replace it)")


@contextlib.contextmanager
def staged_output(out: Path) -> Iterator[Path]:
    """A temporary directory next to ``out``; renamed to ``out`` on success, removed on failure."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """torch.distributed with one gloo process (dist_checkpointing needs a process group), unless one exists."""
    import torch.distributed as dist

    from megatron_dapo.actor.cpu import apply_cpu_shims

    apply_cpu_shims()  # dist_checkpointing calls torch.cuda.synchronize(); a no-op with CUDA
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*cols, disable=not enabled, transient=False)


# ----------------------------------------------------------------------------------------------------------------------
# HF → Megatron


def plan_hf_to_megatron(
    hf_dir: str | Path, model_config: str | Path | ArchConfig | None = None, tp: int = 1, pp: int = 1, ep: int = 1
):
    """Validate an HF checkpoint against the model config (and the target TP/PP); nothing is written.

    Returns ``(arch, {hf name: StEntry}, weight files)``.
    """
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ConfigError(f"{hf_dir}: HF checkpoint directory does not exist")
    hf_cfg = read_hf_config(hf_dir)
    hf_arch = arch_from_hf(hf_cfg, name=hf_dir.name, source=str(hf_dir / "config.json"))
    arch = hf_arch
    if model_config is not None:
        arch = model_config if isinstance(model_config, ArchConfig) else load_arch(model_config)
        compare_arch(arch, hf_arch, str(hf_dir / "config.json"))
    check_divisible(arch, tp, pp, ep=ep)
    files = hf_weight_files(hf_dir)
    entries: dict[str, StEntry] = {}
    for f in files:
        for name, e in read_st_header(f).items():
            entries.setdefault(name, e)
    table = table_for(arch)
    _check_tensors(
        str(hf_dir),
        {n: e.shape for n, e in entries.items()},
        table.hf_shapes(arch),
        lambda n: table.is_ignorable_hf(n, arch),
    )
    return arch, entries, files


def _hf_dtype(hf_dir: Path, entries: dict[str, StEntry]) -> str:
    cfg = read_hf_config(hf_dir)
    name = cfg.get("torch_dtype") or cfg.get("dtype")
    if name in HF_DTYPE_NAMES:
        return HF_DTYPE_NAMES[name]
    first = next(iter(entries.values())).dtype
    return DTYPE_NAMES.get(first, "fp32")


def hf_to_megatron(
    hf_dir: str | Path,
    out_dir: str | Path,
    model_config: str | Path | ArchConfig | None = None,
    tp: int = 1,
    pp: int = 1,
    dtype: str | None = None,
    overwrite: bool = False,
    progress: bool = False,
    ep: int = 1,
) -> ArchConfig:
    """Convert an HF checkpoint into a model-only megatron-core checkpoint loadable at any TP/PP/EP.

    ``tp``/``pp``/``ep`` are checked for divisibility only: the checkpoint itself holds global tensors.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    hf_dir, out = Path(hf_dir), Path(out_dir)
    arch, entries, files = plan_hf_to_megatron(hf_dir, model_config, tp, pp, ep)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: must be one of {', '.join(DTYPES)}")
    dtype = dtype or _hf_dtype(hf_dir, entries)
    check_output_dir(out, overwrite)
    table = table_for(arch)
    by_hf = table.by_hf(arch)
    with staged_output(out) as tmp, single_process_group(), _progress(progress) as bar:
        use_forked_results_queue()
        task = bar.add_task(f"HF → Megatron ({len(files)} shards)", total=len(files))
        parts = []
        for k, f in enumerate(files):
            names = [n for n, e in entries.items() if e.file == f and n in by_hf]
            sharded: dict = {}
            with open(f, "rb") as fh:
                for name in names:
                    param, src = by_hf[name]
                    t = read_st_tensor(entries[name], fh).to(DTYPES[dtype])
                    key, axes = checkpoint_axes(param)
                    pieces = param.pieces(src, t)
                    frags = len(param.layout())
                    for frag, piece in pieces:
                        piece = piece.clone() if frags > 1 else piece  # no views: dist_checkpointing would copy
                        offsets = [(i, index, count) for i, (index, count) in enumerate(axes)]
                        if frags > 1:
                            offsets.append((len(offsets), frag, frags))
                        # Each leading axis (layer, expert) is a real dim of size 1 (not prepend_axis_num): the same
                        # stored chunks as GPTModel's, and a partial save (some layers / pieces only) is allowed.
                        data = piece.reshape((1,) * len(axes) + tuple(piece.shape))
                        sharded[f"{key}/{param.layer}/{param.expert}/{frag}"] = ShardedTensor.from_rank_offsets(
                            key, data, *offsets, replica_id=0
                        )
                    del t, pieces
            part = tmp / f"part{k}"
            part.mkdir()
            dist_checkpointing.save({"model": sharded}, str(part), validate_access_integrity=False)
            parts.append(part)
            del sharded
            bar.advance(task)
        _merge_dcp_parts(parts, tmp)
        for p in parts:
            shutil.rmtree(p)
        write_meta(tmp, arch, dtype, kind="model", tp=tp, pp=pp, ep=ep, source=str(hf_dir.resolve()))
    return arch


def _merge_dcp_parts(parts: list[Path], dest: Path) -> None:
    """Merge torch-DCP checkpoints that hold disjoint chunks into one (files renamed ``__<part>_<n>.distcp``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    merged = None
    for k, part in enumerate(parts):
        with open(part / ".metadata", "rb") as f:
            md = pickle.load(f)
        renames = {}
        for info in md.storage_data.values():
            if info.relative_path not in renames:
                renames[info.relative_path] = f"__{k}_{len(renames)}.distcp"
            info.relative_path = renames[info.relative_path]
        for old, new in renames.items():
            os.replace(part / old, dest / new)
        if merged is None:
            merged = md
            for name in ("metadata.json", "common.pt"):
                if (part / name).exists():
                    os.replace(part / name, dest / name)
            continue
        for key, smd in md.state_dict_metadata.items():
            have = merged.state_dict_metadata.get(key)
            if have is None:
                merged.state_dict_metadata[key] = smd
            elif isinstance(smd, TensorStorageMetadata):
                if have.size != smd.size or have.properties.dtype != smd.properties.dtype:
                    raise RuntimeError(f"merge: {key}: parts disagree on shape or dtype")
                have.chunks.extend(smd.chunks)
        merged.storage_data.update(md.storage_data)
        if isinstance(merged.planner_data, dict) and isinstance(md.planner_data, dict):
            merged.planner_data.update(md.planner_data)
        if getattr(md, "mcore_data", None):
            merged.mcore_data = {**getattr(merged, "mcore_data", {}), **md.mcore_data}
    with open(dest / ".metadata", "wb") as f:
        pickle.dump(merged, f)
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------------------------------------------------
# Reading a megatron dist checkpoint


def tensors_metadata(ckpt_dir: Path) -> tuple[dict, dict]:
    """Every stored tensor's global shape and dtype."""
    from megatron.core import dist_checkpointing

    try:
        meta = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    except Exception as e:  # noqa: BLE001 - a missing/corrupt checkpoint surfaces as many exception types
        raise ConfigError(f"{ckpt_dir}: not a readable megatron dist checkpoint ({type(e).__name__}: {e})") from e
    return {k: tuple(v.global_shape) for k, v in meta.items()}, {k: v.dtype for k, v in meta.items()}


def load_entries(ckpt_dir: Path, entries: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """``{name: (key, axes, stored shape, dtype)}`` → ``{name: the tensor at those leading-axis indices}``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    sharded = {}
    for name, (key, axes, shape, dtype) in entries.items():
        # A real leading dim of 1 per axis (not prepend_axis_num), so that a subset of the layers can be read.
        t = torch.empty((1,) * len(axes) + tuple(shape[len(axes) :]), dtype=dtype)
        offsets = [(i, index, count) for i, (index, count) in enumerate(axes)]
        sharded[name] = ShardedTensor.from_rank_offsets(key, t, *offsets, replica_id=0)
    loaded = dist_checkpointing.load(sharded, str(ckpt_dir), validate_access_integrity=False)
    return {name: loaded[name].reshape(loaded[name].shape[len(entries[name][1]) :]) for name in sharded}


# ----------------------------------------------------------------------------------------------------------------------
# Writing safetensors shards (Megatron → HF, and the trainer's HF export)


class _ShardWriter:
    """Streams tensors into safetensors files of at most ``max_bytes``, planned up front from the known shapes.

    Each file's header is written first, then the tensors as they arrive (in plan order), so nothing but the tensor
    being written is held; plus ``model.safetensors.index.json`` when there is more than one file.
    """

    _NAMES = {v: k for k, v in _ST_DTYPES.items()}

    def __init__(self, out: Path, plan: list[tuple[str, tuple[int, ...], torch.dtype]], max_bytes: int):
        self.out = out
        files: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = [[]]
        size = 0
        for name, shape, dtype in plan:
            nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            if files[-1] and size + nbytes > max_bytes:
                files.append([])
                size = 0
            files[-1].append((name, tuple(shape), dtype, nbytes))
            size += nbytes
        n = len(files)
        self.names = (
            ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self.files = files
        self.order = [(i, e) for i, entries in enumerate(files) for e in entries]
        self.pos, self.fh, self.total = 0, None, sum(e[3] for _, e in self.order)

    def _open(self, i: int) -> None:
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype, nbytes in self.files[i]:
            header[name] = {"dtype": self._NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + nbytes]}
            off += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.fh = open(self.out / self.names[i], "wb")
        self.fh.write(struct.pack("<Q", len(raw)) + raw)

    def add(self, name: str, t: torch.Tensor) -> None:
        i, (want, shape, dtype, nbytes) = self.order[self.pos]
        if name != want or tuple(t.shape) != shape or t.dtype != dtype:
            raise RuntimeError(f"writer: got {name} {tuple(t.shape)} {t.dtype}, planned {want} {shape} {dtype}")
        if self.pos == 0 or self.order[self.pos - 1][0] != i:
            self._close_file()
            self._open(i)
        self.fh.write(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        self.pos += 1

    def _close_file(self) -> None:
        if self.fh is not None:
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self.fh.close()
            self.fh = None

    def close(self) -> None:
        self._close_file()
        if self.pos != len(self.order):
            raise RuntimeError(f"writer: {len(self.order) - self.pos} planned tensors were not written")
        if len(self.names) > 1:
            weight_map = {e[0]: self.names[i] for i, e in self.order}
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ConfigError(f"--max-shard-size {text!r}: expected a size like 2GB or 500MB")
    return int(float(m.group(1)) * 1024 ** "_KMGT".index(m.group(2).upper() or "_"))
