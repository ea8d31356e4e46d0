"""SGLang client side: typed schemas, and the server lifecycle / engine against a real local HTTP process.

The HTTP server used here is a STAND-IN (tests/unit/sglang_standin.py): SGLang cannot run on CPU. It speaks
SGLang 0.5's endpoints and parses every request strictly with the same schema module, so these tests check the
client's processes, HTTP, retries, aborts and weight-sync plumbing, not SGLang's numerics (tests/gpu does that).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_dapo.rollout import sglang_types as T
from megatron_dapo.rollout.engine import RolloutError, SamplingParams, TokenizerInfo, WeightSyncError
from megatron_dapo.rollout.sglang_engine import SGLangEngine, SGLangServer, http_call
from megatron_dapo.rollout.weight_sync import DiskSync

STANDIN = [sys.executable, str(Path(__file__).with_name("sglang_standin.py"))]
pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------------------------------------------------
# Schemas (field names from SGLANG_API.md)


def test_generate_request_json_is_exactly_what_sglang_expects():
    engine = SGLangEngine.__new__(SGLangEngine)  # only the request builder; no servers
    engine.tokenizer = TokenizerInfo(eos_token_ids=(2,), pad_token_id=0)
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=5, stop_token_ids=(9,), seed=3)
    req = SGLangEngine._request(engine, [5, 6, 7], sp, 1234, "rid-1")
    assert req.to_json() == {
        "input_ids": [5, 6, 7],
        "sampling_params": {
            "max_new_tokens": 5,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "stop_token_ids": [2, 9],
            "sampling_seed": 1234,
        },
        "return_logprob": True,
        "rid": "rid-1",
        "stream": False,
    }
    off = SGLangEngine._request(engine, [1], SamplingParams(top_k=-1, logprobs=False), None, "r")
    assert off.to_json()["sampling_params"]["top_k"] == -1 and off.to_json()["return_logprob"] is False
    assert "sampling_seed" not in off.to_json()["sampling_params"]


ROUND_TRIP = [
    T.GenerateRequest(input_ids=[[1, 2], [3]], sampling_params=T.SGLangSamplingParams(n=4, min_p=0.1), rid=["a", "b"]),
    T.GenerateResponse(
        text="hi",
        output_ids=[4, 5],
        meta_info=T.MetaInfo(
            id="x",
            prompt_tokens=3,
            completion_tokens=2,
            finish_reason=T.FinishReason("stop", matched=5),
            output_token_logprobs=[(-0.5, 4, None), (-1.25, 5, "b")],
            weight_version="7",
        ),
    ),
    T.GenerateResponse(meta_info=T.MetaInfo(finish_reason=None)),
    T.UpdateWeightsFromTensorRequest(serialized_named_tensors=["QUJD", "QUJD"], load_format="flattened_bucket"),
    T.InitWeightsUpdateGroupRequest("10.0.0.1", 29600, 1, 9, group_name="g"),
    T.UpdateWeightsFromDistributedRequest(
        names=["a", "b"], dtypes=["bfloat16"] * 2, shapes=[[2, 3], [4]], weight_version="3"
    ),
    T.DestroyWeightsUpdateGroupRequest("g"),
    T.UpdateWeightsFromDiskRequest(model_path="/ckpt", weight_version="2", abort_all_requests=True),
    T.ReleaseMemoryRequest(tags=["kv_cache", "weights"]),
    T.ResumeMemoryRequest(),
    T.GetWeightsByNameRequest(name="model.norm.weight", truncate_size=4),
    T.AbortRequest(rid="r1"),
    T.UpdateWeightVersionRequest(new_version="5"),
    T.SuccessResponse(True, "ok", 0),
]


@pytest.mark.parametrize("obj", ROUND_TRIP, ids=lambda o: type(o).__name__)
def test_schema_round_trip(obj):
    import json

    wire = json.loads(json.dumps(obj.to_json()))  # through real JSON text
    assert type(obj).from_json(wire) == obj


def test_schema_required_fields_and_strictness():
    assert T.InitWeightsUpdateGroupRequest("h", 1, 1, 2).to_json() == {
        "master_address": "h",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "weight_update_group",
        "backend": "nccl",
    }
    with pytest.raises(T.SchemaError, match="unknown field.*max_tokens"):
        T.SGLangSamplingParams.from_json({"max_tokens": 3})  # the OpenAI spelling: silently ignored by SGLang
    with pytest.raises(T.SchemaError, match="missing required.*model_path"):
        T.UpdateWeightsFromDiskRequest.from_json({"weight_version": "1"})
    with pytest.raises(T.SchemaError, match="lengths differ"):
        T.UpdateWeightsFromDistributedRequest(names=["a"], dtypes=[], shapes=[[1]])
    with pytest.raises(T.SchemaError, match="memory tag"):
        T.ReleaseMemoryRequest(tags=["kv"])


def test_parse_a_real_shaped_sglang_answer():
    answer = {  # shape of SGLang 0.5 /generate with return_logprob (extra fields are ignored)
        "text": " 42",
        "output_ids": [17, 2],
        "meta_info": {
            "id": "abc",
            "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": 5,
            "weight_version": "default",
            "completion_tokens": 2,
            "cached_tokens": 0,
            "e2e_latency": 0.1,
            "output_token_logprobs": [[-0.25, 17, None], [-0.75, 2, None]],
        },
    }
    r = T.GenerateResponse.from_json(answer)
    assert r.token_ids == [17, 2] and r.logprobs == [-0.25, -0.75] and r.finish_type == "stop"
    del answer["output_ids"]
    assert T.GenerateResponse.from_json(answer).token_ids == [17, 2]  # fallback: ids from the logprob triples


# ----------------------------------------------------------------------------------------------------------------------
# Lifecycle against a real process


def standin(tmp_path: Path, *extra: str, model_path: Path | None = None) -> SGLangServer:
    return SGLangServer(
        model_path or tmp_path,
        launcher=STANDIN,
        extra_args=list(extra),
        log_path=tmp_path / f"server_{len(list(tmp_path.glob('server_*.log')))}.log",
        mem_fraction=0.5,
        memory_saver=True,
    )


def stats(server: SGLangServer) -> dict:
    return http_call(server.url, "/standin_stats")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_wait_generate_stop(tmp_path):
    server = standin(tmp_path, "--startup-delay", "0.5")
    assert server.argv()[len(STANDIN) :][:2] == ["--model-path", str(tmp_path)]
    assert "--enable-memory-saver" in server.argv() and "--mem-fraction-static" in server.argv()
    engine = SGLangEngine([server], tokenizer_info=TokenizerInfo((), 0), max_concurrency=4)
    try:
        pid = stats(server)["pid"]
        sp = SamplingParams(max_new_tokens=6, seed=1)
        out = engine.generate([[1, 2, 3], [4, 5]], sp, n=3)
        assert [(s.prompt_index, s.sample_index) for s in out] == [(p, j) for p in range(2) for j in range(3)]
        assert all(len(s.response_ids) == 6 == len(s.logprobs) and s.finish_reason == "length" for s in out)
        assert out[0].response_ids != out[1].response_ids  # per-sample seeds
        assert engine.generate([[1, 2, 3], [4, 5]], sp, n=3)[4].response_ids == out[4].response_ids  # deterministic
        engine.sleep(["kv_cache"])
        engine.wake()
        assert stats(server)["released"] == [["kv_cache"]] and stats(server)["resumed"] == [None]
    finally:
        engine.shutdown()
    time.sleep(0.2)
    assert not alive(pid), "stop() must end the process it started"


def test_wait_timeout_carries_log_tail(tmp_path):
    server = standin(tmp_path, "--never-ready")
    server.start()
    try:
        with pytest.raises(RolloutError, match=r"(?s)not healthy after 2 s.*pretending to load weights forever"):
            server.wait_healthy(timeout=2)
    finally:
        server.stop()


def test_early_exit_reports_code_and_log(tmp_path):
    server = standin(tmp_path, "--no-such-flag")
    server.start()
    with pytest.raises(RolloutError, match=r"(?s)exited with code 2.*unrecognized arguments: --no-such-flag"):
        server.wait_healthy(timeout=30)


def test_attached_server_is_never_stopped(tmp_path):
    owner = standin(tmp_path)
    owner.start()
    try:
        owner.wait_healthy(30)
        attached = SGLangServer.attach(owner.url)
        engine = SGLangEngine([attached], max_concurrency=2)
        assert engine.generate([[3]], SamplingParams(max_new_tokens=2))[0].finish_reason == "length"
        engine.shutdown()
        assert owner.healthy(), "shutting down an engine must not stop a server it only attached to"
        with pytest.raises(RolloutError, match="attached"):
            attached.start()
    finally:
        owner.stop()


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(8, 12, generator=g),
        "model.norm.weight": torch.randn(8, generator=g),
    }


def test_server_death_restart_resync_and_reissue(tmp_path):
    marker = tmp_path / "died"
    server = standin(tmp_path, "--token-delay", "0.05", "--die-after-generates", "3", "--die-marker", str(marker))
    resynced = []

    def resync(dead):
        resynced.append([s.url for s in dead])
        DiskSync(engine, directory=tmp_path / "resync").sync([list(weights.items())], engine.weight_version, dead)

    engine = SGLangEngine([server], max_concurrency=8, resync=resync, server_timeout=60)
    try:
        weights = _tensors(0)
        report = DiskSync(engine, directory=tmp_path / "w").sync([list(weights.items())], version=1)
        assert report.verified == 3 and engine.weight_version == 1
        prompts = [[i, i + 1] for i in range(4)]
        sp = SamplingParams(max_new_tokens=5, seed=11)
        out = engine.generate(prompts, sp, n=2)  # 8 requests; the server dies on the 4th
        assert marker.exists(), "the fault was not injected"
        assert engine.metrics["restarts"] == 1 and resynced == [[server.url]]
        assert engine.metrics["reissued"] >= 1
        assert len(out) == 8 and all(s.finish_reason == "length" and len(s.response_ids) == 5 for s in out)
        assert {s.weight_version for s in out} == {1}, "re-issued samples must come from the resynced weights"
        again = engine.generate(prompts, sp, n=2)  # healthy now: the same deterministic answers
        assert [s.response_ids for s in again] == [s.response_ids for s in out], (
            "a re-issued sample was lost or changed"
        )
    finally:
        engine.shutdown()


def test_restart_without_resync_refuses_stale_weights(tmp_path):
    marker = tmp_path / "died"
    server = standin(tmp_path, "--die-after-generates", "0", "--die-marker", str(marker))
    engine = SGLangEngine([server], max_concurrency=2, server_timeout=60)
    try:
        DiskSync(engine, verify="off", directory=tmp_path / "w").sync([list(_tensors(0).items())], version=4)
        with pytest.raises(RolloutError, match="stale weights"):
            engine.generate([[1]], SamplingParams(max_new_tokens=2))
    finally:
        engine.shutdown()


def test_stream_then_abort_surplus(tmp_path):
    server = standin(tmp_path, "--slow-first-token", "7")
    engine = SGLangEngine([server], max_concurrency=8)
    try:
        prompts = [[1], [7], [2], [7], [3]]  # the [7] prompts take 1 s per token
        sp = SamplingParams(max_new_tokens=30)
        t0 = time.monotonic()
        kept = []
        for group in engine.generate_stream(prompts, sp, n=1):
            kept.append(group[0].prompt_index)
            if len(kept) == 3:
                engine.abort()
                break
        assert sorted(kept) == [0, 2, 4]
        deadline = time.monotonic() + 10
        while len(stats(server)["abort_rids"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(stats(server)["abort_rids"]) == 2, "both slow requests must be aborted on the server by rid"
        assert time.monotonic() - t0 < 15, "abort must not wait for the surplus to finish (30 s)"
        assert engine.generate([[5]], SamplingParams(max_new_tokens=2))[0].finish_reason == "length"
    finally:
        engine.shutdown()


def test_abort_from_another_thread_ends_samples_with_abort(tmp_path):
    server = standin(tmp_path, "--slow-first-token", "7")
    engine = SGLangEngine([server], max_concurrency=4)
    try:
        threading.Timer(1.5, engine.abort).start()
        t0 = time.monotonic()
        out = list(engine.generate_stream([[7], [7]], SamplingParams(max_new_tokens=30), n=1))
        assert out == [], "groups aborted mid-flight are not yielded"
        assert time.monotonic() - t0 < 10, "the stream must end at the abort, not after 30 s"
        assert len(stats(server)["abort_rids"]) == 2
    finally:
        engine.shutdown()


def test_disk_sync_verified_and_corruption_named(tmp_path):
    good = standin(tmp_path)
    bad = standin(tmp_path, "--corrupt-on-load", "model.layers.0.mlp.down_proj.weight")
    engine = SGLangEngine([good, bad], max_concurrency=2)
    try:
        weights = list(_tensors(1).items())
        with pytest.raises(WeightSyncError, match=rf"down_proj.weight' on {bad.url}"):
            DiskSync(engine, directory=tmp_path / "w").sync([weights], version=2)
        report = DiskSync(engine, directory=tmp_path / "w2").sync([weights[:2], weights[2:]], version=3, workers=[good])
        assert (report.tensors, report.verified, report.bytes) == (3, 3, sum(t.numel() * 4 for _, t in weights))
        assert stats(good)["version"] == "3"
        sampled = DiskSync(engine, verify="sample", directory=tmp_path / "w3")
        sampled.sample_size = 1
        assert sampled.sync([weights], version=4, workers=[good]).verified == 1
    finally:
        engine.shutdown()


def test_router_generates_but_weight_sync_goes_to_workers(tmp_path):
    worker = standin(tmp_path)
    router = standin(tmp_path, "--router")
    router.start()
    try:
        router.wait_healthy(30)
        engine = SGLangEngine([worker], router_url=router.url, max_concurrency=2)
        engine.generate([[1], [2]], SamplingParams(max_new_tokens=2))
        assert stats(router)["generate"] == 2 and stats(worker)["generate"] == 0
        DiskSync(engine, directory=tmp_path / "w").sync([list(_tensors(2).items())], version=1)
        assert stats(worker)["updates"] == 1
        engine.shutdown()
    finally:
        router.stop()
