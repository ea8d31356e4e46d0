"""Requests in flight per SGLang server: each worker of an engine gets its own bound, sized from what the server
reports (/server_info), capped by rollout.max_concurrency. Stub HTTP (no server); the read of a real server's report
is checked in tests/sglang/test_server.py."""

from __future__ import annotations

import collections
import threading
import time

import pytest

from megatron_dapo.config.run_config import load_config
from megatron_dapo.engines.sglang import aborts as sglang_aborts
from megatron_dapo.engines.sglang import client as sglang_engine
from megatron_dapo.engines.sglang.capacity import per_server_concurrency
from megatron_dapo.engines.sglang.client import SGLangEngine
from megatron_dapo.engines.sglang.server import ServerUnavailable
from megatron_dapo.types import SamplingParams

pytestmark = pytest.mark.timeout(120)

N_SERVERS = 32  # the 32B recipe's layout: 16 nodes x 8 GPUs, SGLang TP 4


class FakeServers:
    """/server_info reports ``capacity`` (as SGLang 0.5.23's internal state does); /generate blocks until released,
    counting each server's requests in flight."""

    def __init__(self, capacity: int | None):
        self.capacity, self.release = capacity, threading.Event()
        self.lock = threading.Lock()
        self.now: collections.Counter = collections.Counter()
        self.peak: collections.Counter = collections.Counter()

    def __call__(self, url, path, body=None, timeout=60.0, **kw):
        if path == "/server_info":
            if self.capacity is None:
                raise ServerUnavailable(f"GET {url}{path}: HTTP 404")
            return {"max_running_requests": None, "internal_states": [
                {"effective_max_running_requests_per_dp": self.capacity}]}  # fmt: skip
        if path == "/abort_request":  # noted, never acted on: what SGLang does for a request it has not registered
            return {}
        assert path == "/generate", path
        with self.lock:
            self.now[url] += 1
            self.peak[url] = max(self.peak[url], self.now[url])
        self.release.wait(60)
        with self.lock:
            self.now[url] -= 1
        return {"output_ids": [3], "meta_info": {"id": body["rid"], "finish_reason": {"type": "length"},
                                                 "output_token_logprobs": [[-0.5, 3, None]]}}  # fmt: skip

    def wait_for(self, total: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while sum(self.now.values()) < total and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # would any server take more than its bound?


def _engine(monkeypatch, fake: FakeServers, overrides=()) -> SGLangEngine:
    monkeypatch.setattr(sglang_engine, "http_call", fake)
    monkeypatch.setattr(sglang_aborts, "http_call", fake)  # the abort calls
    cfg = load_config("dapo_32b", list(overrides))
    urls = [f"http://10.0.{i // 8}.{i % 8}:30000" for i in range(N_SERVERS)]
    return SGLangEngine.from_config(cfg, None, server_urls=urls, start=False)


def _generate_all(engine: SGLangEngine, fake: FakeServers, requests: int, expect_in_flight: int) -> None:
    prompts = [[1, 2, i % 7 + 3] for i in range(requests)]
    out: list = []
    t = threading.Thread(target=lambda: out.extend(engine.generate(prompts, SamplingParams(max_new_tokens=1), n=1)))
    t.start()
    try:
        fake.wait_for(expect_in_flight)
    finally:
        fake.release.set()
        t.join(60)
    assert len(out) == requests


@pytest.mark.parametrize(("capacity", "cap"), [(48, 512), (1024, 24)])
def test_every_server_gets_its_own_full_concurrency(monkeypatch, capacity, cap):
    """32 servers: each holds min(its capacity, rollout.max_concurrency) requests at once (512 is the 32B recipe's
    cap), not the ~16 a single pool of 512 shared by all would leave it."""
    fake = FakeServers(capacity)
    engine = _engine(monkeypatch, fake, [f"rollout.max_concurrency={cap}"])
    try:
        want = min(capacity, cap)
        _generate_all(engine, fake, N_SERVERS * want + 64, N_SERVERS * want)
        assert engine.concurrency == {s.url: want for s in engine.servers}
        assert dict(fake.peak) == {s.url: want for s in engine.servers}, "some server got fewer or more requests"
    finally:
        engine.shutdown(stop_servers=False)


def test_a_server_that_reports_nothing_gets_the_configured_cap(monkeypatch):
    fake = FakeServers(None)
    engine = _engine(monkeypatch, fake, ["rollout.max_concurrency=6"])
    try:
        _generate_all(engine, fake, N_SERVERS * 6 + 10, N_SERVERS * 6)
        assert set(engine.concurrency.values()) == {6} and set(fake.peak.values()) == {6}
    finally:
        engine.shutdown(stop_servers=False)


def test_per_server_concurrency_from_the_config_alone():
    cfg = load_config("dapo_32b")
    assert per_server_concurrency(cfg, 200) == 200  # the server's bound
    assert per_server_concurrency(cfg, 4096) == cfg.rollout.max_concurrency == 512  # the config's cap
    assert per_server_concurrency(cfg, None) == 512  # nothing reported: the cap


def test_open_file_limit_bounds_the_connections(monkeypatch):
    """Every request in flight holds a connection: past RLIMIT_NOFILE they fail as "too many open files", which the
    engine would take for dead servers. 32 servers × 48 with 1,024 descriptors: scaled down to fit (less the reserve)."""
    from megatron_dapo.engines.sglang import capacity as sglang_capacity

    monkeypatch.setattr(sglang_engine, "open_file_budget", lambda: 1024)
    fake = FakeServers(48)
    engine = _engine(monkeypatch, fake)
    try:
        _generate_all(engine, fake, N_SERVERS * 30, N_SERVERS * 24)
        room = 1024 - sglang_capacity.FD_RESERVE
        assert sum(engine.concurrency.values()) <= room and set(engine.concurrency.values()) == {room // N_SERVERS}
        assert max(fake.peak.values()) <= room // N_SERVERS
    finally:
        engine.shutdown(stop_servers=False)
    assert sglang_capacity.fit_open_files({"a": 10, "b": 20}, 1000) == {"a": 10, "b": 20}  # fits: unchanged


def test_open_file_budget_raises_the_soft_limit():
    import resource

    from megatron_dapo.engines.sglang.capacity import open_file_budget

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(512, hard), hard))
        assert open_file_budget() == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_background_reabort_stops_at_shutdown(monkeypatch):
    """abort() leaves a thread re-aborting what has not answered; shutdown() ends it."""
    fake = FakeServers(4)
    engine = _engine(monkeypatch, fake, ["rollout.max_concurrency=4"])
    prompts = [[1, 2, 3]] * 8
    t = threading.Thread(target=lambda: list(engine.generate_stream(prompts, SamplingParams(max_new_tokens=1))))
    t.start()
    try:
        fake.wait_for(8)
        engine.abort()  # the fake never answers the abort: the requests stay in flight, the thread keeps trying
        assert any(th.name == "sglang-reabort" for th in threading.enumerate())
        engine.shutdown(stop_servers=False)
        time.sleep(0.5)
        assert not any(th.name == "sglang-reabort" and th.is_alive() for th in threading.enumerate())
    finally:
        fake.release.set()
        t.join(60)
