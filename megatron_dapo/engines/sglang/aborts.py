"""Aborting what an SGLang engine has in flight (``SGLangEngine.abort``), so that nothing keeps running its whole
budget after an abort: a request still on its way to a worker when the abort comes is aborted again once it arrives."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Iterable

from megatron_dapo.engines.sglang import types as T
from megatron_dapo.engines.sglang.server import http_call
from megatron_dapo.types import RolloutError

log = logging.getLogger(__name__)


class Aborts:
    """``SGLangEngine``'s abort machinery. It reads the engine's ``_abort_gate`` and ``_lock``, ``_abort_gen`` (the
    abort generation, bumped by each abort), ``_inflight`` (rid -> (url, generation) of each request sent and not yet
    answered), ``worker_urls``, ``router_url``, ``request_timeout`` and ``_closed`` (set at shutdown)."""

    def abort(self) -> None:
        """Drop every request in flight: unstarted ones are cancelled, the workers abort all they hold
        (``abort_all``), and what reaches a worker after that is aborted as it arrives (``_reabort_stale``).

        SGLang 0.5.23 drops an abort for a rid it has not registered (``tokenizer_manager.py`` ``abort_request``: no
        state and one tokenizer worker: return), ignores a second abort of a rid (``state.abort_sent``), and its
        scheduler keeps no abort for a request it has not received (``scheduler.py`` ``abort_request``): a request
        still on its way (HTTP queue, tokenization) when the abort comes would run its whole budget."""
        with self._abort_gate:
            with self._lock:
                self._abort_gen += 1
                gen = self._abort_gen
                urls = {u for u, _ in self._inflight.values()}
            if not urls:
                return
            self._abort_calls([(w, T.AbortRequest(abort_all=True)) for w in self._workers_of(urls)])
        threading.Thread(target=self._reabort_until_back, args=(gen,), name="sglang-reabort", daemon=True).start()

    def _workers_of(self, urls: Iterable[str]) -> list[str]:  # a router's URL: every worker (it 404s aborts)
        return sorted({w for u in urls for w in (self.worker_urls if u == self.router_url else [u])})

    def _abort_calls(self, calls: list[tuple[str, T.AbortRequest]]) -> None:
        if not calls:
            return
        with cf.ThreadPoolExecutor(max_workers=max(1, min(32, len(calls)))) as ex:
            for fut in [ex.submit(http_call, u, "/abort_request", req.to_json(), 30) for u, req in calls]:
                try:
                    fut.result()
                except RolloutError as e:  # a dead server has nothing left to abort
                    log.warning("abort: %s", e)

    def _reabort_stale(self, before: int | None = None) -> int:
        """Abort again each request of an aborted generation (older than ``before``, default the current one) still
        unanswered: it may have reached its worker after the abort. A worker with no request of the current
        generation gets ``abort_all`` (no rid left un-abortable), the others an abort by rid. Returns how many."""
        with self._abort_gate:
            with self._lock:
                before = self._abort_gen if before is None else before
                stale = [(rid, u) for rid, (u, g) in self._inflight.items() if g < before]
                live = set(self._workers_of(u for u, g in self._inflight.values() if g == self._abort_gen))
            stale_workers = set(self._workers_of(u for _, u in stale))
            self._abort_calls([(w, T.AbortRequest(abort_all=True)) for w in sorted(stale_workers - live)])
        self._abort_calls([(w, T.AbortRequest(rid=r)) for r, u in stale for w in self._workers_of([u]) if w in live])
        return len(stale)

    def _reabort_until_back(self, gen: int, poll_s: float = 0.2) -> None:
        """Re-abort what was sent before abort generation ``gen`` until all of it has answered or the engine shuts
        down (a background thread: an error is logged, never raised)."""
        deadline = time.monotonic() + self.request_timeout
        try:
            while time.monotonic() < deadline and not self._closed.wait(poll_s):
                if not self._reabort_stale(gen):
                    return
        except Exception as e:  # the servers stopping under it, the interpreter exiting
            log.warning("re-abort of requests sent before abort %d stopped: %s", gen, e)
