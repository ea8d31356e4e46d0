"""Requests in flight per SGLang server: what each server reports it runs at once, capped by the config, and bounded
by the file descriptors this process may open (every request in flight holds one connection)."""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable

from megatron_dapo.types import RolloutError

log = logging.getLogger(__name__)

# descriptors kept for everything else the driver opens (logs, checkpoints, sockets of the process groups)
FD_RESERVE = 256


def server_capacity(url: str, call: Callable, timeout: float = 60.0) -> int | None:
    """The requests a server runs at once: its schedulers' ``effective_max_running_requests_per_dp`` in /server_info's
    ``internal_states`` (sglang 0.5.23 ``scheduler_components/internal_state.py``: the scheduler's
    ``max_running_requests``, derived from its KV pool unless set), else the configured ``max_running_requests``;
    None when it answers neither. ``call``: ``sglang_server.http_call`` or a stand-in."""
    try:
        info = call(url, "/server_info", None, timeout)
    except RolloutError as e:
        log.warning("%s: no /server_info (%s): its requests in flight fall back to rollout.max_concurrency", url, e)
        return None
    info = info if isinstance(info, dict) else {}
    n = sum(int(s.get("effective_max_running_requests_per_dp") or 0) for s in info.get("internal_states") or [])
    return n or (int(info["max_running_requests"]) if info.get("max_running_requests") else None)


def per_server_concurrency(cfg, server_capacity: int | None = None) -> int:
    """Requests the engine keeps in flight on ONE server: what the server runs at once (``server_capacity``), capped
    by ``rollout.max_concurrency`` (``cfg``: the config, or that cap); the cap alone when the server reports nothing.
    Each server has its own bound: a pool shared by all would leave ~cap / servers requests on each."""
    cap = int(cfg.rollout.max_concurrency if hasattr(cfg, "rollout") else cfg)
    return max(1, min(cap, server_capacity) if server_capacity else cap)


def open_file_budget() -> int:
    """The descriptors this process may open, after raising its soft RLIMIT_NOFILE to the hard limit (a login shell's
    soft limit is often 1024; 32 servers × 512 requests need 16k connections)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("could not raise RLIMIT_NOFILE from %s to %s: %s", soft, target, e)
    return soft


def fit_open_files(concurrency: dict[str, int], budget: int) -> dict[str, int]:
    """``concurrency`` (URL → requests in flight) scaled down in proportion so that its sum stays within ``budget``
    descriptors less ``FD_RESERVE``: past it connections fail as "too many open files", which the engine would take
    for dead servers. Unchanged when it fits."""
    total, room = sum(concurrency.values()), max(budget - FD_RESERVE, len(concurrency))
    if total <= room:
        return dict(concurrency)
    scaled = {url: max(1, n * room // total) for url, n in concurrency.items()}
    log.warning(
        "%d requests in flight over %d servers need more connections than RLIMIT_NOFILE %d allows: %d per server "
        "instead (raise the limit, e.g. `ulimit -n`, or lower rollout.max_concurrency)",
        total,
        len(concurrency),
        budget,
        min(scaled.values()),
    )
    return scaled
