"""Actor checkpoints with megatron-core ``dist_checkpointing``: resharding-capable (save at one TP/PP, load at another).

Layout of a checkpoint directory (written to ``.<name>.tmp`` and renamed when complete, so a crash never leaves a
directory that looks complete):
- the ``torch_dist`` files of ``dist_checkpointing`` holding ``model`` (+ ``optimizer``, ``rng``) sharded tensors and
  common state (``scheduler``, ``step``, ``extra``: the caller's data cursor, sampler state, ...);
- ``dapo_meta.json``: format tag, architecture, real vocab size, dtype, the TP/PP it was written at, step; for a LoRA
  run its ``lora`` settings, and, when the checkpoint holds the adapters alone (``"weights": "adapters"``), where the
  frozen base comes from (``base``: ``{"hf_init": dir}`` or ``{"load": checkpoint}``) and the base's fingerprint.
Parameter keys are canonical (the local layer spec's names), so a checkpoint written on CPU loads under the
Transformer Engine spec on GPU and back: TE fuses the pre-attention / pre-MLP norms into the following linear layer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.actor.dist import rng_state, set_rng_state
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import ArchConfig, compare_arch
from megatron_dapo.runs import META_FILE, CheckpointError, checkpoints, die_with_parent, dir_bytes, is_complete

FORMAT = "megatron-dapo/1"
# TE spec key suffix -> canonical (local spec) key suffix
_TE_TO_CANONICAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def use_forked_results_queue() -> None:
    """Workaround, kept here only: megatron-core's ``FileSystemWriterAsync`` hands write results back through a
    multiprocessing Manager queue started with *spawn* (``dist_checkpointing.strategies.filesystem_async.
    _get_write_results_queue``). The spawned server imports torch when it first unpickles a ``WriteResult``: about 2 s
    on the first save of every process (measured: the first queue ``put`` takes 2.2 s, later ones 5 ms). A *forked*
    Manager starts with torch already loaded; the same upstream save forks its writer processes anyway
    (``write_preloaded_data_multiproc``). A no-op once the queue exists or if a newer megatron-core drops the global. The forked server dies with the trainer:
    a trainer killed by SIGKILL would otherwise leave it running, holding the trainer's stdout and stderr (whoever
    reads them, a test or a pipe, then waits for good)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        manager.start(initializer=die_with_parent, initargs=(signal.SIGKILL, os.getpid()))
        filesystem_async._results_queue = manager.Queue()


def canonical_key(key: str) -> str:
    for te, local in _TE_TO_CANONICAL.items():
        if key.endswith(te):
            return key[: -len(te)] + local
    return key


def _model_sharded_state_dict(actor) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    sd = actor.model[0].module.sharded_state_dict()
    for value in sd.values():
        if isinstance(value, ShardedBase):
            value.key = canonical_key(value.key)
    return {k: v for k, v in sd.items() if not k.endswith("_extra_state")}


def _is_adapter_key(key: str) -> bool:
    return ".lora_" in key


def base_source(cfg) -> dict | None:
    """Where a LoRA run's frozen base comes from when its checkpoints hold the adapters alone (``model.lora.checkpoint
    = adapters`` and a base read from a file); None when checkpoints hold every weight. A ``model.load`` that itself
    holds adapters alone names its own base: that is this run's base too."""
    m = cfg.model
    if not m.lora.rank or m.lora.checkpoint != "adapters":
        return None
    if m.load:
        meta = read_meta(m.load)
        return meta["base"] if meta.get("weights") == "adapters" else {"load": str(Path(m.load).resolve())}
    return {"hf_init": str(Path(m.hf_init).resolve())} if m.hf_init else None


def base_location(base: dict, path) -> Path:
    """The file or folder ``base`` (``{"hf_init": dir}`` / ``{"load": checkpoint}``) names, which must exist."""
    where = Path(next(iter(base.values())))
    if not where.exists():
        raise ConfigError(f"{path} holds LoRA adapters alone; its base {where} does not exist (a run names where the "
                          "base is now by model.hf_init / model.load)")  # fmt: skip
    return where


def base_fingerprint(actor) -> list[float]:
    """The frozen base's weights as [sum, sum of squares] in float64 over the whole model: each element counted once,
    on the rank that holds its main replica (what ``dist_checkpointing`` saves), so the same at any TP/PP up to
    rounding (the vocabulary's padding rows, more of them at a larger TP, are zeros). Cached: the base never changes
    during a run."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica

    if getattr(actor, "_base_fingerprint", None) is None:
        acc = torch.zeros(2, dtype=torch.float64, device=actor.device)
        for key, sh in _model_sharded_state_dict(actor).items():
            if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and not _is_adapter_key(key):
                if is_main_replica(sh.replica_id):
                    x = sh.data.detach().to(torch.float64)
                    acc += torch.stack([x.sum(), (x * x).sum()])
        dist.all_reduce(acc)
        actor._base_fingerprint = acc.tolist()
    return actor._base_fingerprint


def check_base(actor, meta: dict, path) -> None:
    """The base just loaded under an adapters-only checkpoint must be the base it was trained on (a PEFT adapter
    converted by ``dapo convert`` names its base by path only: no fingerprint to check)."""
    if "base_fingerprint" not in meta:
        return
    want, got = meta["base_fingerprint"], base_fingerprint(actor)
    if any(abs(g - w) > 1e-9 * max(1.0, abs(w)) for g, w in zip(got, want)):
        raise ConfigError(
            f"{path} holds LoRA adapters trained on the base {meta['base']}, but the base loaded now differs "
            f"(sum and sum of squares of its weights: {got} vs {want} at save): load the base it was trained on"
        )


def _rng_object(state=None):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", state, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def read_meta(path) -> dict:
    return json.loads((Path(path) / META_FILE).read_text())


def _has_optimizer_state(actor) -> bool:
    """Adam has no state before its first update; such a checkpoint stores no optimizer tensors."""
    opts = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    return any(len(o.optimizer.state) for o in opts)


def _estimated_bytes(actor, has_optimizer: bool, directory: Path, adapters_only: bool) -> int:
    """What the checkpoint will take on disk: the size of the newest one in ``directory``, or, for the first, this
    model's tensors (+ Adam's two fp32 moments, + an fp32 master copy of 16-bit weights) over one data-parallel
    replica. Every rank takes part in the sum; rank 0's answer is the one used."""
    from megatron.core import parallel_state

    def per_param(p) -> int:
        return p.element_size() + ((8 + (4 if p.element_size() < 4 else 0)) if has_optimizer else 0)

    saved = [p for _, p in actor.named_parameters() if p.requires_grad or not adapters_only]
    local = sum(p.numel() * per_param(p) for p in saved)
    local = local if parallel_state.get_data_parallel_rank() == 0 else 0
    total = torch.tensor([local], dtype=torch.float64, device=actor.device)
    dist.all_reduce(total)
    done = checkpoints(directory) if dist.get_rank() == 0 else []
    return dir_bytes(done[-1][1]) if done else int(total.item())


def _space_problem(directory: Path, need: int) -> str | None:
    free = shutil.disk_usage(directory).free
    if free >= need * 1.05 + (1 << 20):
        return None
    return f"{free / 2**20:.1f} MiB free on the device of {directory}, about {need / 2**20:.1f} MiB needed"


def _fail_save(path: Path, tmp: Path, why: str) -> CheckpointError:
    """Drop the partial write; the error names what was kept (the newest complete checkpoint beside it)."""
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    kept = checkpoints(path.parent)
    kept_msg = f"the previous checkpoint {kept[-1][1]} is kept" if kept else "there is no earlier checkpoint"
    return CheckpointError(f"checkpoint {path} was not written ({why}); {kept_msg}")


def save(actor, path, extra: dict) -> None:
    """Write to ``.<name>.tmp`` and rename when complete. Refused up front when the filesystem lacks the space; a
    failed write (disk full, quota) removes the partial directory: either way the earlier checkpoints stay and a
    ``CheckpointError`` (on every rank) says so."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    has_optimizer = _has_optimizer_state(actor)
    base = base_source(actor.cfg)  # not None: the adapters alone
    need = _estimated_bytes(actor, has_optimizer, path.parent, base is not None)
    problem = None
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        problem = _space_problem(path.parent, need)
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise _fail_save(path, tmp, box[0])
    if dist.get_rank() == 0:
        tmp.mkdir(parents=True)
    dist.barrier()
    fingerprint = base_fingerprint(actor) if base else None
    model_sd = _model_sharded_state_dict(actor)
    if base:  # the frozen base is in its own file: the adapters (and their optimizer state) alone
        model_sd = {k: v for k, v in model_sd.items() if _is_adapter_key(k)}
    state = {
        "model": model_sd,
        "optimizer": actor.optimizer.sharded_state_dict(model_sd) if has_optimizer else {},
        "rng": _rng_object(rng_state()),
        "scheduler": actor.scheduler.state_dict(),
        "step": actor.step,
        "skipped_updates": actor.skipped_updates,
        "extra": extra,
    }
    use_forked_results_queue()
    error = None
    try:
        dist_checkpointing.save(state, str(tmp))
    except (OSError, CheckpointException) as e:  # CheckpointException is a BaseException
        # a full disk reads e.g. "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
        error = (str(e).strip().splitlines() or [type(e).__name__])[-1]
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)  # a failure of one rank (e.g. rank 0's metadata write) fails them all
    failed = [(rank, err) for rank, err in enumerate(errors) if err]
    if failed:
        space = _space_problem(path.parent, need)
        raise _fail_save(path, tmp, f"no space left: {space}" if space else f"rank {failed[0][0]}: {failed[0][1]}")
    if dist.get_rank() == 0:
        meta = {
            "format": FORMAT,
            "kind": "full",  # "model" for model-only checkpoints (tools/convert_hf_to_megatron.py)
            "optimizer_state": has_optimizer,
            "arch": dataclasses.asdict(actor.arch),
            "vocab_size": actor.arch.vocab_size,
            "dtype": actor.cfg.model.dtype,
            "tp": actor.cfg.parallel.tp,
            "pp": actor.cfg.parallel.pp,
            "world_size": dist.get_world_size(),
            "step": actor.step,
            "weights": "adapters" if base else "all",
        }
        lora = actor.cfg.model.lora
        if lora.rank:
            meta["lora"] = {
                "rank": lora.rank,
                "alpha": lora.alpha,
                "dropout": lora.dropout,
                "targets": list(lora.targets),
            }
        if base:
            meta.update(base=base, base_fingerprint=fingerprint)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        if path.exists():
            old = path.parent / f".{path.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old)
        else:
            tmp.rename(path)
    dist.barrier()


def check_arch(path, arch: ArchConfig) -> dict:
    """The checkpoint's metadata, once it is known to be a complete checkpoint of architecture ``arch`` (cheap: run it
    before building a model); errors name the checkpoint and the first differing field."""
    path = Path(path)
    if not is_complete(path):
        raise ConfigError(f"{path}: not a complete megatron-dapo checkpoint (no {META_FILE})")
    meta = read_meta(path)
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path}/{META_FILE}: format {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        saved = ArchConfig(**meta["arch"])
    except TypeError as e:
        raise ConfigError(f"{path}/{META_FILE}: unreadable architecture ({e})") from e
    compare_arch(arch, saved, f"{path} (architecture {saved.name}) vs model.arch = {arch.name}")
    return meta


def load(actor, path, load_optimizer: bool = True, base_loaded: bool = False) -> dict:
    """Load model (and optimizer, scheduler, RNG, step when present and asked); return the caller's ``extra``.

    A checkpoint that holds LoRA adapters alone needs its base in the model first (``bridge.load.load_checkpoint``
    loads it and passes ``base_loaded``); it is then checked against the checkpoint's fingerprint."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    meta = check_arch(path, actor.arch)
    adapters_only = meta.get("weights") == "adapters"
    if adapters_only and not base_loaded:
        raise ConfigError(f"{path} holds LoRA adapters alone: load its base {meta['base']} first "
                          "(megatron_dapo.bridge.load.load_checkpoint does)")  # fmt: skip
    mine, saved = getattr(getattr(actor, "cfg", None), "model", None), meta.get("lora")
    if saved and mine is not None and (mine.lora.rank, mine.lora.alpha) != (saved["rank"], saved["alpha"]):
        raise ConfigError(f"{path} holds LoRA adapters of rank {saved['rank']}, alpha {saved['alpha']}; the model has "
                          f"model.lora.rank = {mine.lora.rank}, model.lora.alpha = {mine.lora.alpha}")  # fmt: skip
    model_sd = _model_sharded_state_dict(actor)
    if adapters_only:
        check_base(actor, meta, path)
        model_sd = {k: v for k, v in model_sd.items() if _is_adapter_key(k)}
        if not model_sd:
            raise ConfigError(f"{path} holds LoRA adapters alone, and this model has none (model.lora.rank = 0)")
    elif not saved:  # a checkpoint without adapters as a LoRA run's base: the adapters keep their initial values
        model_sd = {k: v for k, v in model_sd.items() if not _is_adapter_key(k)}
    request = {"model": model_sd}
    full = load_optimizer and meta.get("kind", "full") == "full"
    with_optimizer = full and meta.get("optimizer_state", False)
    if with_optimizer:
        request["optimizer"] = actor.optimizer.sharded_state_dict(model_sd, is_loading=True)
    if full:
        if meta.get("world_size") == dist.get_world_size():
            request["rng"] = _rng_object()
    state = dist_checkpointing.load(request, str(path))
    missing, unexpected = actor.model[0].module.load_state_dict(state["model"], strict=False)
    wanted = _is_adapter_key if adapters_only else (lambda k: saved or not _is_adapter_key(k))
    missing = [k for k in missing if not k.endswith("_extra_state") and wanted(k)]
    if missing or unexpected:
        raise ValueError(f"{path}: model tensors missing {missing} / unexpected {unexpected}")
    if with_optimizer:
        actor.optimizer.load_state_dict(state["optimizer"])
    if full:
        actor.scheduler.load_state_dict(state["scheduler"])
        actor.step = state.get("step", 0)
        actor.skipped_updates = state.get("skipped_updates", 0)
        if "rng" in state:
            set_rng_state(state["rng"])
    return state.get("extra", {}) if full else {}
