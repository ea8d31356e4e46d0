"""The memory phases against the real SGLang server on CPU cores (issue 14): what the server sees, in order.

On a CPU the server runs without ``--enable-memory-saver`` (torch_memory_saver is CUDA-only): SGLang's memory-saver
adapter is then a no-op, so /release_memory_occupation and /resume_memory_occupation are accepted (200), flush the
cache, stash and restore the weights' static state, and free nothing. The calls, their order and the idle wait before
a release (SGLang asserts an idle server: an assertion in its scheduler) are what these tests check.
"""

from __future__ import annotations

import re
import threading
import time

from megatron_dapo.engines.sglang.sync import TensorSync
from megatron_dapo.loop.phases import MemoryPhases
from megatron_dapo.types import SamplingParams
from tests.sglang.helpers import buckets

ENDPOINTS = ("/v1/loads", "/release_memory_occupation", "/resume_memory_occupation", "/generate", "/abort_request",
             "/flush_cache", "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update",
             "/weights_checker")  # fmt: skip


def seen(server, since: int) -> list[str]:
    """The endpoints the server logged (uvicorn access log) since byte ``since``, in order, repeats collapsed."""
    text = server.log_path.read_text(errors="replace")[since:]
    out = []
    for m in re.finditer(r'"(?:GET|POST) (/[\w/]+)[^"]*" (\d+)', text):
        path = m.group(1)
        if path in ENDPOINTS and (not out or out[-1] != f"{path} {m.group(2)}"):
            out.append(f"{path} {m.group(2)}")
    return out


def test_release_train_resume_sync_generate_on_the_real_server(engine, server, initial_weights):
    """One step of the colocated loop; issue 22 #9: the weights alone are resumed before the sync, the KV cache and
    CUDA graphs after it (the second /resume_memory_occupation), before the next generation."""
    since = len(server.log_path.read_text(errors="replace"))
    calls = []
    phases = MemoryPhases(engine, "actor", offload=lambda a: calls.append("offload"),
                          reload=lambda a: calls.append("reload"))  # fmt: skip
    released = [getattr(engine, "released", list)()]  # from the start: until the first generation
    # a rollout whose surplus is aborted mid-generation, as dynamic sampling does: the release must wait for idle
    sampling = SamplingParams(max_new_tokens=400, temperature=1.0)  # no EOS: runs to the cap
    worker = threading.Thread(target=lambda: engine.generate([[1, 2, 3]] * 4, sampling, n=2), daemon=True)
    worker.start()
    time.sleep(1.0)
    engine.abort()
    worker.join(60)
    released.append(getattr(engine, "released", list)())
    phases.to_train()
    calls.append("train")
    released.append(getattr(engine, "released", list)())
    phases.to_rollout()
    released.append(getattr(engine, "released", list)())
    report = TensorSync(engine).sync(buckets(initial_weights), version=engine.weight_version)  # the server's own
    released.append(getattr(engine, "released", list)())
    out = engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    released.append(getattr(engine, "released", list)())
    assert out[0].finish_reason == "length" and engine.health() and report.verified
    order = [e for e in seen(server, since) if not e.startswith(("/abort_request", "/v1/loads", "/flush_cache 400"))]
    last_release = len(order) - 1 - order[::-1].index("/release_memory_occupation 200")
    assert order[last_release - 1 :] == [
        "/flush_cache 200", "/release_memory_occupation 200",  # to_train: a flush that succeeds, then the release
        "/resume_memory_occupation 200",  # to_rollout: the weights (before the fix: everything, here)
        "/begin_weight_update 200", "/update_weights_from_tensor 200", "/end_weight_update 200", "/flush_cache 200",
        "/weights_checker 200",  # the sync, its buckets beside the weights alone
        "/resume_memory_occupation 200",  # KV cache + CUDA graphs, at the next generation
        "/generate 200",
    ], order  # fmt: skip
    first = order.index("/resume_memory_occupation 200")
    assert order[:first] == ["/flush_cache 200", "/release_memory_occupation 200"], order  # the constructor's
    rollout = order[first + 1 : last_release - 1]
    assert rollout and all(e.startswith("/generate") for e in rollout), order
    assert "/v1/loads 200" in seen(server, since)  # the idle wait asked the server
    kv = ["kv_cache", "cuda_graph"]
    assert released == [kv, [], ["kv_cache", "weights", "cuda_graph"], kv, kv, []]
    assert calls == ["offload", "reload", "train", "offload"]
