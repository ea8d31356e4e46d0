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

from megatron_dapo.rollout.engine import SamplingParams
from megatron_dapo.rollout.phases import MemoryPhases

ENDPOINTS = ("/v1/loads", "/release_memory_occupation", "/resume_memory_occupation", "/generate", "/abort_request")


def seen(server, since: int) -> list[str]:
    """The endpoints the server logged (uvicorn access log) since byte ``since``, in order, repeats collapsed."""
    text = server.log_path.read_text(errors="replace")[since:]
    out = []
    for m in re.finditer(r'"(?:GET|POST) (/[\w/]+)[^"]*" (\d+)', text):
        path = m.group(1)
        if path in ENDPOINTS and (not out or out[-1] != f"{path} {m.group(2)}"):
            out.append(f"{path} {m.group(2)}")
    return out


def test_release_train_resume_generate_on_the_real_server(engine, server):
    since = len(server.log_path.read_text(errors="replace"))
    calls = []
    phases = MemoryPhases(engine, "actor", offload=lambda a: calls.append("offload"),
                          reload=lambda a: calls.append("reload"))  # fmt: skip
    # a rollout whose surplus is aborted mid-generation, as dynamic sampling does: the release must wait for idle
    sampling = SamplingParams(max_new_tokens=400, temperature=1.0)  # no EOS: runs to the cap
    worker = threading.Thread(target=lambda: engine.generate([[1, 2, 3]] * 4, sampling, n=2), daemon=True)
    worker.start()
    time.sleep(1.0)
    engine.abort()
    worker.join(60)
    phases.to_train()
    calls.append("train")
    phases.to_rollout()
    out = engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert out[0].finish_reason == "length" and engine.health()
    assert calls == ["reload", "train", "offload"]
    order = [e for e in seen(server, since) if not e.startswith(("/abort_request", "/v1/loads"))]
    # the rollout's requests, then release -> resume -> the next generation, each answered 200
    first_release = order.index("/release_memory_occupation 200")
    assert order[first_release:] == ["/release_memory_occupation 200", "/resume_memory_occupation 200",
                                     "/generate 200"], order  # fmt: skip
    assert all(e.startswith("/generate") for e in order[:first_release]) and order[:first_release]
    assert "/v1/loads 200" in seen(server, since)  # the idle wait asked the server
