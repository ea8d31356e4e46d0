"""The transports into vLLM servers by ``rollout.weight_sync`` (engines/registry.py ``sync_factory``): ``disk``
(``sync.py``, anywhere) and ``distributed`` (``nccl_sync.py``, vLLM's NCCL weight transfer, GPUs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_dapo.engines.vllm.nccl_sync import VLLMNcclSync
from megatron_dapo.engines.vllm.sync import VLLMDiskSync


def sync_from_config(cfg: Any, engine: Any, kind: str) -> VLLMDiskSync:
    """The transport ``kind`` (rollout.weight_sync: disk, or distributed on GPUs: vLLM's NCCL weight transfer,
    ``nccl_sync.py``) into ``engine``'s servers, verified per ``rollout.verify_sync`` (engines/registry.py
    ``sync_factory``)."""
    from megatron_dapo.models.arch import load_arch
    from megatron_dapo.ports import JobPorts

    if kind not in ("disk", "distributed"):
        raise ValueError(f"rollout.weight_sync = {kind!r}: vLLM takes disk or distributed")
    directory = Path(cfg.train.run_dir) / cfg.train.name / "weight_sync"
    head_dim = load_arch(cfg.model.arch).head_dim
    if kind == "disk":
        return VLLMDiskSync(engine, cfg.rollout.verify_sync, head_dim=head_dim, directory=directory)
    job_ports = JobPorts.from_env()
    return VLLMNcclSync(engine, cfg.rollout.verify_sync, head_dim=head_dim, directory=directory,
                        master_port=job_ports.weight_sync if job_ports else None)  # fmt: skip
