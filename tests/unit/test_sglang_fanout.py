"""How SGLangEngine spreads /generate requests over its workers (rollout.fanout); the routing alone, no HTTP."""

from __future__ import annotations

import pytest

from megatron_dapo.engines.sglang.client import SGLangEngine
from megatron_dapo.engines.sglang.server import SGLangServer

URLS = ["http://a:1", "http://b:2"]


def _engine(fanout: str) -> SGLangEngine:
    servers = [SGLangServer.attach(u, device="cpu") for u in URLS]
    return SGLangEngine(servers, fanout=fanout, start=False, max_concurrency=2)


def test_prompt_fanout_keeps_a_prompts_samples_together_on_the_least_loaded_worker():
    eng, routes = _engine("prompt"), {}
    sent = {(p, j): eng._pick_url(routes, p, f"r{p}-{j}") for p in range(4) for j in range(3)}
    for p in range(4):
        assert len({sent[p, j] for j in range(3)}) == 1, f"prompt {p}'s samples split over workers"
    assert sorted(sent[p, 0] for p in range(4)) == sorted(URLS * 2), "a batch submitted at once alternates"
    # the worker that finishes its requests gets the next prompts (its batch would otherwise run dry)
    busy = sent[0, 0]
    idle = next(u for u in URLS if u != busy)
    for p in range(4):
        if sent[p, 0] == idle:
            for j in range(3):
                eng._unassign(f"r{p}-{j}", idle)
    assert eng._pick_url(routes, 4, "r4-0") == idle and eng._pick_url(routes, 5, "r5-0") == idle
    # a re-issued request (its worker died) is placed again by load, not pinned to the dead worker
    assert eng._pick_url(routes, 0, "r0-0-retry", retry=True) == idle


def test_request_fanout_round_robins_every_request():
    eng, routes = _engine("request"), {}
    sent = [eng._pick_url(routes, 0, f"r{j}") for j in range(4)]
    assert sent[0] != sent[1] and sent[0::2] == [sent[0]] * 2 and sent[1::2] == [sent[1]] * 2


def test_unknown_fanout_is_refused():
    with pytest.raises(ValueError, match="rollout.fanout = 'random'"):
        _engine("random")
