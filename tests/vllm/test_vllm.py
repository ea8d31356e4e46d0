"""The vLLM engine against the REAL vLLM 0.32 server on CPU cores: samples and logprobs as transformers computes them,
seeds per sample, a verified weight sync that serves the new weights (no stale prefix cache, no missed reload),
aborts that keep what was generated, and routes no one without the job's key may call."""

from __future__ import annotations

import dataclasses
import threading
import time

import psutil
import pytest

from megatron_dapo.engines.sglang.auth import api_key
from megatron_dapo.engines.sglang.server import ServerRequestError, http_call
from megatron_dapo.engines.vllm.sync import VLLMDiskSync
from megatron_dapo.types import GenRequest, SamplingParams, WeightSyncError
from tests.sglang.helpers import buckets, corrupting, hf_logprobs, mean_gap
from tests.vllm.helpers import flat_weights, make_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
LONG = [(7 * i + 3) % 32 for i in range(200)]  # fills one 128-token block of vLLM's CPU prefix cache
SAMPLING = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)


@pytest.fixture
def engine(server):
    if not server.healthy():
        server.restart(300)
    eng = make_engine(server)
    yield eng
    eng.shutdown(stop_servers=False)


@pytest.fixture
def restore(engine, initial_weights, tmp_path):
    """Whatever a test syncs, the server serves the initial weights again afterwards."""
    yield
    VLLMDiskSync(engine, head_dim=32, directory=tmp_path / "restore").sync(buckets(initial_weights), 0)


def test_samples_and_logprobs_are_what_transformers_computes(engine, initial_weights):
    out = engine.generate(PROMPTS, SAMPLING, n=3)
    assert [(s.prompt_index, s.sample_index) for s in out] == [(p, j) for p in range(3) for j in range(3)]
    assert all(len(s.response_ids) == 12 and s.finish_reason == "length" for s in out)
    assert all(len(s.logprobs) == 12 for s in out)
    # bf16 server vs transformers in bf16 on the same weights
    assert mean_gap(out, hf_logprobs(initial_weights, out)) < 0.02
    again = engine.generate(PROMPTS, SAMPLING, n=3)
    assert [s.response_ids for s in again] == [s.response_ids for s in out], "a sample's seed fixes its tokens"
    groups = [{tuple(s.response_ids) for s in out if s.prompt_index == p} for p in range(3)]
    assert any(len(g) > 1 for g in groups), "the samples of a prompt draw from different seeds"
    other = engine.generate(PROMPTS, dataclasses.replace(SAMPLING, seed=4), n=3)
    assert [s.response_ids for s in other] != [s.response_ids for s in out]


def test_temperature_scales_the_logprobs(engine, initial_weights):
    sp = dataclasses.replace(SAMPLING, temperature=0.6)
    out = engine.generate(PROMPTS, sp, n=2)
    assert mean_gap(out, hf_logprobs(initial_weights, out, temperature=0.6)) < 0.02
    assert mean_gap(out, hf_logprobs(initial_weights, out, temperature=1.0)) > 0.05


def test_a_sync_serves_the_new_weights_and_no_prefix_computed_with_the_old(engine, initial_weights, restore, tmp_path):
    """The long prompt's first KV block is cached under the initial weights; after the sync the server must compute
    it again: a sync without the pause's clear_cache (reload_weights keeps the prefix cache) fails here."""
    before = engine.generate([LONG], SAMPLING, n=2)
    assert mean_gap(before, hf_logprobs(initial_weights, before)) < 0.02
    new = flat_weights(seed=1)
    report = VLLMDiskSync(engine, head_dim=32, directory=tmp_path / "w").sync(buckets(new), 1)
    assert report.verified == 16 and report.tensors == len(new)  # 16 server parameters from 26 HF tensors
    assert engine.weight_version == 1
    assert http_call(engine.servers[0].url, "/weight_info")["weight_version"] == "1"
    after = engine.generate([LONG], SAMPLING, n=2)
    assert all(s.weight_version == 1 for s in after)
    assert mean_gap(after, hf_logprobs(new, after)) < 0.02, "served from the new weights, every position"
    assert mean_gap(after, hf_logprobs(initial_weights, after)) > 0.1


def test_a_missed_reload_fails_verification(engine, initial_weights, restore, tmp_path):
    """The files are written but the server is never told to read them: the checksums read back from the server
    (worker_ext.dapo_checksums, through the CPU's packed linears) name the stale tensors."""
    sync = VLLMDiskSync(engine, head_dim=32, directory=tmp_path / "w")
    post = sync._post
    sync._post = lambda servers, path, body, quiet=False: (
        [None] * len(servers) if body.get("method") == "reload_weights" else post(servers, path, body, quiet)
    )
    with pytest.raises(WeightSyncError, match=r"failed verification: tensor 'model\.") as e:
        sync.sync(buckets(flat_weights(seed=1)), 1)
    assert "mlp.gate_up_proj" in str(e.value) or "qkv_proj" in str(e.value) or "embed_tokens" in str(e.value)
    assert engine.weight_version == 0
    assert http_call(engine.servers[0].url, "/is_paused")["is_paused"] is False, "resumed after a failed sync"


def test_corruption_on_the_way_is_named(engine, restore, tmp_path):
    sync = corrupting(VLLMDiskSync(engine, head_dim=32, directory=tmp_path / "w"), "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(WeightSyncError, match=r"'model.layers.1.mlp.gate_proj.weight' \+ "
                                              r"'model.layers.1.mlp.up_proj.weight' \(fused as"):  # fmt: skip
        sync.sync(buckets(flat_weights(seed=2)), 1)


def test_abort_returns_what_each_request_has(engine):
    """Partial rollout: aborted requests come back with finish_reason 'abort', their tokens and logprobs so far."""
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=4))  # warm (a fresh server compiles kernels first)
    requests = [GenRequest([1, 2, 3], 500, seed=i) for i in range(8)]
    got = []

    def run():
        got.extend(engine.generate_requests(requests, SamplingParams(max_new_tokens=500, temperature=1.0)))

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while not engine._inflight and time.monotonic() < deadline:  # the requests have been sent
        time.sleep(0.01)
    time.sleep(0.3)  # ... and generated a few tokens (the whole 500 take seconds on 2 cores)
    engine.abort()
    t.join(120)
    assert not t.is_alive() and len(got) == 8
    aborted = [s for s in got if s.finish_reason == "abort"]
    assert aborted, [(s.finish_reason, len(s.response_ids)) for s in got]
    assert any(s.response_ids for s in aborted), "an aborted request keeps the tokens it had"
    for s in aborted:
        assert len(s.response_ids) < 500 and len(s.logprobs) == len(s.response_ids)
    assert engine.metrics["aborted"] == len(aborted)


def test_the_sync_routes_need_the_jobs_key(server):
    """vLLM's --api-key guards /v1 only; the guard middleware guards /collective_rpc, /pause, ... too."""
    for path, body in [("/collective_rpc", {"method": "dapo_checksums"}), ("/pause", {}), ("/abort_requests", {})]:
        with pytest.raises(ServerRequestError, match="HTTP 401"):
            http_call(server.url, path, body, key="not-the-key")
        with pytest.raises(ServerRequestError, match="HTTP 401"):
            http_call(server.url, path, body, key="")
    assert http_call(server.url, "/health", key="") is None  # probes stay open
    assert http_call(server.url, "/is_paused")["is_paused"] is False
    key = api_key()
    assert key not in server.log_path.read_text()
    procs = [psutil.Process(server.pid())] + psutil.Process(server.pid()).children(recursive=True)
    for p in procs:
        assert all(key not in arg for arg in p.cmdline()), p.cmdline()
