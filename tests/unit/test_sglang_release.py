"""SGLangEngine.sleep / wake against a stand-in server (the real one: tests/sglang/test_release_idle.py, test_phases.py):
a release only after a /flush_cache that answers 200 (issue 22 #1), a clear error instead of a release when it never
does, and each tag released or resumed once (SGLang's resume of a tag it did not release raises in its scheduler)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_dapo.engines.sglang.client import SGLangEngine
from megatron_dapo.engines.sglang.server import SGLangServer
from megatron_dapo.types import RolloutError


class Stub:
    def __init__(self, flush_refusals: int):
        self.refusals, self.seen = flush_refusals, []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self, code: int, body) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.do_POST()

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"null")
                path = self.path.split("?")[0]
                if path == "/v1/loads":
                    return self._answer(200, {"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]})
                if path == "/flush_cache" and stub.refusals:
                    stub.refusals -= 1
                    stub.seen.append("flush 400")
                    return self._answer(400, "Cache not flushed")
                stub.seen.append(path.strip("/") + (f" {','.join(body['tags'])}" if (body or {}).get("tags") else ""))
                return self._answer(200, {"success": True})

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def engine(self) -> SGLangEngine:
        return SGLangEngine([SGLangServer.attach(self.url, device="cpu")], start=False, server_timeout=10)


@pytest.fixture
def stub(request):
    s = Stub(getattr(request, "param", 0))
    yield s
    s.http.shutdown()


@pytest.mark.parametrize("stub", [2], indirect=True)
def test_release_waits_for_a_flush_that_succeeds(stub):
    stub.engine().sleep(idle_timeout_s=30)
    assert stub.seen == [
        "flush 400",
        "flush 400",
        "flush_cache",
        "release_memory_occupation kv_cache,weights,cuda_graph",
    ]


@pytest.mark.parametrize("stub", [10**6], indirect=True)
def test_a_server_never_idle_is_a_clear_error_and_nothing_is_released(stub):
    with pytest.raises(RolloutError, match=rf"{stub.url}: /flush_cache still refused after 1 s .*not idle"):
        stub.engine().sleep(idle_timeout_s=1)
    assert stub.seen and all(s == "flush 400" for s in stub.seen)


def test_each_tag_is_released_and_resumed_once(stub):
    engine = stub.engine()
    engine.sleep(["kv_cache", "cuda_graph"])
    engine.sleep()  # only what it still holds
    engine.sleep()  # nothing left: no call at all
    engine.wake(["weights"])
    engine.wake(["weights"])  # resumed already
    engine.wake()
    assert [s for s in stub.seen if not s.startswith("flush")] == [
        "release_memory_occupation kv_cache,cuda_graph", "release_memory_occupation weights",
        "resume_memory_occupation weights", "resume_memory_occupation kv_cache,cuda_graph",
    ]  # fmt: skip
    assert engine.released() == []
