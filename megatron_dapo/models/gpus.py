"""GPU facts the planner and the engines' memory models share: the memory a GPU kind exposes."""

from __future__ import annotations

MiB = 1 << 20

# What nvidia-smi's memory.total reports (MiB), = torch.cuda.get_device_properties(i).total_memory / 2**20; SGLang's
# heuristics read this very number (get_nvgpu_memory_capacity, srt/utils/common.py:802-832: the MIN over the GPUs).
# Not vendor-documented: the value commonly reported by public nvidia-smi logs (H100 80GB HBM3: 81559 MiB =
# 85,520,809,984 B; H200: 143771 MiB; A100-SXM4-80GB: 81920 MiB). The nominal "80 GB" is 80e9 B or so, less what the
# driver keeps (ECC, reserved).
GPU_MEMORY_MIB = {"h100-80gb": 81559, "h200-141gb": 143771, "a100-80gb": 81920}
GPU_MEMORY_GIB = {kind: mib / 1024 for kind, mib in GPU_MEMORY_MIB.items()}  # h100-80gb: 79.65
# nominal GB (what a datasheet or a config says) -> kind; 80 GB is read as an H100 (the smaller of H100 and A100)
NOMINAL_KIND = {80: "h100-80gb", 141: "h200-141gb"}


def gpu_total_bytes(kind: str) -> int:
    """Bytes a GPU kind exposes (``GPU_MEMORY_MIB``); KeyError names the known kinds."""
    if kind not in GPU_MEMORY_MIB:
        raise KeyError(f"GPU kind {kind!r}: known are {', '.join(GPU_MEMORY_MIB)}")
    return GPU_MEMORY_MIB[kind] * MiB


def gpu_total_gib(nominal_gb: float) -> float:
    """The GiB a GPU sold as ``nominal_gb`` GB exposes (80 -> 79.65, an H100; 141 -> 140.40, an H200); a nominal size
    not in ``NOMINAL_KIND`` is returned as it is (taken to be GiB already)."""
    kind = NOMINAL_KIND.get(int(nominal_gb)) if float(nominal_gb).is_integer() else None
    return GPU_MEMORY_GIB[kind] if kind else float(nominal_gb)
