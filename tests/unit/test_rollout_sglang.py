"""SGLang client side without a server: the typed request/response schemas.

Everything that talks to a server (lifecycle, generation, aborts, restarts, every weight-sync transport) is tested
against the real SGLang server in tests/sglang/.
"""

from __future__ import annotations

import pytest

from megatron_dapo.engines.sglang import types as T
from megatron_dapo.engines.sglang.client import SGLangEngine
from megatron_dapo.types import SamplingParams, TokenizerInfo

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------------------------------------------------
# Schemas (the field names are checked against SGLang's own request classes in tests/sglang/test_contract.py)


def test_generate_request_json_is_exactly_what_sglang_expects():
    engine = SGLangEngine.__new__(SGLangEngine)  # only the request builder; no servers
    engine.tokenizer = TokenizerInfo(eos_token_ids=(2,), pad_token_id=0)
    engine.routes = None  # a dense model: no routed experts asked for
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
    from megatron_dapo.engines.sglang.routes import RouteLayout

    engine.routes = RouteLayout(num_layers=4, moe_layers=(0, 1, 2, 3), topk=2)  # MoE: each response's experts
    assert SGLangEngine._request(engine, [1], sp, None, "r").to_json()["return_routed_experts"] is True


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
    T.BeginWeightUpdateRequest(),
    T.EndWeightUpdateRequest(),
    T.CheckWeightsRequest(action="checksum", skip_tensor_list=["rotary"]),
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


def test_a_request_the_pool_starts_after_an_abort_is_neither_sent_nor_counted(monkeypatch):
    """generate_stream queues every request on a pool of max_concurrency threads: a thread freed by the abort may pick
    up a queued request before the stream cancels it. It must see the abort and send nothing (seen: all 6 of 6 sent
    and counted under load, tests/sglang/test_server.py::test_stream_then_abort_the_surplus)."""
    from megatron_dapo.engines.sglang import aborts as sglang_aborts
    from megatron_dapo.engines.sglang import client as sglang_engine
    from megatron_dapo.engines.sglang.server import SGLangServer

    sent = []
    for module in (sglang_engine, sglang_aborts):  # requests, and the abort calls
        monkeypatch.setattr(module, "http_call", lambda url, path, *a, **k: sent.append(path))
    engine = SGLangEngine([SGLangServer.attach("http://127.0.0.1:9", device="cpu")], dtype="bfloat16", start=False)
    req = engine._request([1, 2], SamplingParams(max_new_tokens=4), seed=0, rid="r-0-0-1")
    stale = engine._abort_gen
    engine.abort()  # nothing in flight: no /abort_request either
    sample = engine._run((0, 0), req, stale, "http://127.0.0.1:9")
    assert sample.finish_reason == "abort" and sample.response_ids == []
    assert sent == [] and engine.metrics["requests"] == 0 and not engine._inflight
