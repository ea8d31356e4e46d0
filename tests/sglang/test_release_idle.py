"""Issue 22 #1 against the REAL SGLang 0.5.23 server on CPU cores: a release while /v1/loads reads idle but the
scheduler is not.

SGLang's /release_memory_occupation handler asserts ``is_fully_idle()`` (``scheduler_components/weight_updater.py``
``release_memory_occupation``; ``scheduler.py`` ``is_fully_idle``: no running batch, no ``chunked_req``, no last
batch, an empty result queue, an empty waiting queue). A failed assert inside the scheduler's request dispatcher ends
its event loop and ``run_scheduler_process`` SIGQUITs the server. /v1/loads counts only the running batch and the
waiting queue (``scheduler_components/load_inquirer.py`` ``get_loads``), so during a chunked prefill it reads
0 running, 0 waiting. Before the fix, ``SGLangEngine.sleep`` waited on /v1/loads alone and killed the server here
(seen: "AssertionError: release_memory_occupation should be called only when server is idle", then "SIGQUIT
received"); it now waits for a /flush_cache that succeeds (slime's order), which SGLang runs only when fully idle.
"""

from __future__ import annotations

import threading
import time

import pytest

from megatron_dapo.engines.sglang.server import http_call
from megatron_dapo.types import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
PROMPT = [1 + i % 30 for i in range(480)]  # 60 chunks of 8 tokens (the tiny model's positions: 512)


def loads_idle_while_prefilling(server, worker, timeout_s: float = 30.0) -> dict | None:
    """Poll /v1/loads until it reads 0 running, 0 waiting while the KV cache holds tokens of the request still in
    flight (``worker`` waits for its answer): the window."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and worker.is_alive():
        load = http_call(server.url, "/v1/loads?include=core")["loads"][0]
        if load.get("num_used_tokens") and not load.get("num_running_reqs") and not load.get("num_waiting_reqs"):
            return load
        time.sleep(0.005)
    return None


def test_release_during_a_chunked_prefill_waits_instead_of_killing_the_server(engine, server):
    """On the session's server (tests/sglang/conftest.py), which prefills in chunks of 8 tokens."""
    since = len(server.log_path.read_text(errors="replace"))
    out: list = []
    worker = threading.Thread(target=lambda: out.extend(engine.generate([PROMPT], SamplingParams(max_new_tokens=1))))
    worker.start()
    window = loads_idle_while_prefilling(server, worker)
    assert window is not None, "the chunked prefill was never seen: nothing tested"
    engine.sleep()  # before the fix: the assert in SGLang's scheduler, SIGQUIT, a dead server
    assert server.healthy(), server.log_path.read_text(errors="replace")[-3000:]
    worker.join(120)
    assert [s.finish_reason for s in out] == ["length"]  # the prefill finished, then the release
    log = server.log_path.read_text(errors="replace")[since:]
    assert "should be called only when server is idle" not in log
    assert log.index("/flush_cache?timeout=") < log.index('"POST /release_memory_occupation HTTP/1.1" 200')
    engine.wake()
    again = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert again[0].finish_reason == "length" and engine.released() == []
