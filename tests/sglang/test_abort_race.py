"""On the REAL SGLang 0.5.23 CPU server (the session's): an abort that reaches the server before the request it
aborts, and the per-server bound on requests in flight read from what the server reports."""

from __future__ import annotations

import re
import time

import pytest

from megatron_dapo.engines.sglang import aborts as sglang_aborts
from megatron_dapo.engines.sglang import capacity as sglang_capacity
from megatron_dapo.engines.sglang import client as sglang_engine
from megatron_dapo.engines.sglang.server import http_call
from megatron_dapo.types import GenRequest, SamplingParams
from tests.sglang.helpers import make_engine

pytestmark = pytest.mark.timeout(300)

LONG = 480  # new tokens (context 512): seconds of decoding; the tiny model has no EOS
DELAY = 1.0  # the long request's time on its way to the server (HTTP queue, tokenization under load)


def _server_requests(url: str) -> int:
    loads = http_call(url, "/v1/loads?include=core", timeout=30)["loads"]
    return sum(d["num_running_reqs"] + d["num_waiting_reqs"] for d in loads)


def test_a_request_that_reaches_the_server_after_the_abort_is_aborted_too(engine, server, monkeypatch):
    """The synchronous schedule's cut: the first result is in, abort the rest. The long request is still on its way
    (SGLang has not registered its rid, so an abort by rid is dropped); once it arrives it must be aborted too, and
    wait_idle must wait for that rather than see an idle server before the request got there."""
    real = sglang_engine.http_call

    def late(url, path, body=None, *args, **kwargs):
        if path == "/generate" and body["sampling_params"]["max_new_tokens"] == LONG:
            time.sleep(DELAY)
        return real(url, path, body, *args, **kwargs)

    monkeypatch.setattr(sglang_engine, "http_call", late)

    monkeypatch.setattr(sglang_aborts, "http_call", late)  # the abort calls
    requests = [GenRequest([1, 2, 3], 1, seed=0), GenRequest([1, 2, 4], LONG, seed=1)]
    try:
        for first in engine.generate_requests(requests, SamplingParams(max_new_tokens=LONG)):
            assert first.prompt_index == 0 and engine._inflight, "the long request is on its way at the cut"
            engine.abort()
            break
        start = time.monotonic()
        engine.wait_idle(timeout_s=10)
        waited = time.monotonic() - start
        assert not engine._inflight, "wait_idle returned while the aborted request was still generating"
        assert _server_requests(server.url) == 0
        assert waited < 8, f"wait_idle took {waited:.1f} s"
        assert engine.metrics["aborted"] == 1, "the long request ended by the abort, not at its budget"
    finally:  # never leave the long request running for the next test
        deadline = time.monotonic() + 120
        while engine._inflight and time.monotonic() < deadline:
            http_call(server.url, "/abort_request", {"abort_all": True}, timeout=30)
            time.sleep(0.2)


def test_the_engine_bounds_each_server_by_what_it_reports(server):
    """/server_info's effective max_running_requests is what the scheduler logged at start-up; each worker's bound
    is it, capped by max_concurrency."""
    logged = re.findall(r"max_running_requests=(\d+)", server.log_path.read_text())
    assert logged, f"no max_running_requests in {server.log_path}"
    capacity = sglang_capacity.server_capacity(server.url, sglang_engine.http_call)
    assert capacity == int(logged[-1])
    for cap in (4, capacity + 100):
        engine = make_engine(server, max_concurrency=cap)
        try:
            engine._ensure_pools()
            assert engine.concurrency == {server.url: min(cap, capacity)}
        finally:
            engine.shutdown(stop_servers=False)
