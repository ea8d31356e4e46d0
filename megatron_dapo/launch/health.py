"""How long to wait for the rollout servers, and what to say while they load.

Loading is bound by the shared filesystem: every server reads the whole model (16 servers of a 32B bf16 model read
16 x 65 GB at once). The wait is ``rollout.server_timeout_s`` (start-up, CUDA graphs) plus twice the time to read
that many bytes at ``cluster.fs_read_gbps`` (aggregate), so it scales with the model and the number of servers.
"""

from __future__ import annotations

from pathlib import Path

from megatron_dapo.config.run_config import DapoConfig
from megatron_dapo.models.arch import load_arch

_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def health_timeout_s(cfg: DapoConfig, servers: int) -> float:
    from megatron_dapo.models.memory import total_params

    weights = total_params(load_arch(cfg.model.arch)) * _DTYPE_BYTES[cfg.model.dtype]
    return cfg.rollout.server_timeout_s + 2 * servers * weights / (cfg.cluster.fs_read_gbps * 1e9)


def last_line(path: str | Path, width: int = 120) -> str:
    """The last non-empty line of a log (progress bars rewrite one line with carriage returns: the latest part)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            tail = f.read().decode(errors="replace")
    except OSError:
        return "(no log yet)"
    parts = [p.strip() for line in tail.splitlines() for p in line.split("\r") if p.strip()]
    return (parts[-1][:width] if parts else "(log empty)") if tail else "(log empty)"


def progress(pending: list, total: int, elapsed: float, timeout: float) -> str:
    """One line per wait report: how many are up, the time spent of the budget, each pending server's log tail."""
    head = f"{total - len(pending)}/{total} servers healthy after {elapsed:.0f} s (of {timeout:.0f} s); waiting for"
    return head + "".join(f"\n    {s.nodes[0]} ({s.url}): {last_line(s.log)}" for s in pending)
