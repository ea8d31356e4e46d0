"""The project's SGLangServer / SGLangEngine against the REAL SGLang 0.5.23 server on CPU cores: start-up, health,
generation with logprobs (the T=1 convention), stop tokens, aborts, death + restart + resync, the router."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from megatron_dapo.engines.sglang.server import ServerRequestError, SGLangServer, http_call
from megatron_dapo.engines.sglang.sync import DiskSync
from megatron_dapo.types import RolloutError, SamplingParams
from tests.sglang.helpers import ARCH, cpu_server, hf_logprobs, make_engine, mean_gap, random_weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 10, 11, 12]]
LONG = 480  # new tokens (context 512): seconds of decoding (the tiny model's config has no EOS: no early stop)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_argv_has_the_platform_flags_and_refuses_data_parallel(model_dir, tmp_path):
    s = cpu_server(model_dir, tmp_path / "x.log")
    argv = " ".join(s.argv())
    assert "--device cpu --attention-backend torch_native" in argv and "--sleep-on-idle" in argv
    assert s.env["SGLANG_USE_CPU_ENGINE"] == "1" and s.env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "0"
    assert s.env["PYTHONPATH"].split(os.pathsep)[0].endswith("tests/sglang_cpu_support")
    gpu = SGLangServer(model_dir, port=1)
    assert "--device" not in gpu.argv() and "PYTHONPATH" not in gpu.env
    with pytest.raises(ValueError, match="dp_size == 1"):
        SGLangServer(model_dir, port=1, extra_args=["--dp-size", "2"])


def test_generate_with_logprobs_of_the_sampling_temperature(engine, initial_weights, tmp_path):
    DiskSync(engine, directory=tmp_path).sync([list(initial_weights.items())], version=1)
    assert engine.health()
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.5, max_new_tokens=8), n=3)
    assert [(s.prompt_index, s.sample_index) for s in out] == [(p, j) for p in range(3) for j in range(3)]
    assert all(len(s.response_ids) == len(s.logprobs) == 8 and s.finish_reason == "length" for s in out)
    assert {s.weight_version for s in out} == {1}
    # SGLANG_RETURN_ORIGINAL_LOGPROB=0: log_softmax(logits / T) at the sampling temperature, as the actor computes
    scaled, t1 = mean_gap(out, hf_logprobs(initial_weights, out, 0.5)), mean_gap(out, hf_logprobs(initial_weights, out))
    assert scaled < 0.03, f"bf16 server vs bf16 transformers at T = 0.5: mean |dlogp| = {scaled}"
    assert t1 > 10 * scaled


def test_stop_token_ends_the_sample_and_is_included(engine):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    ref = engine.generate([PROMPTS[0]], greedy)[0]
    stop = ref.response_ids[2]
    first = ref.response_ids.index(stop)
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(stop,)))[0]
    assert out.finish_reason == "stop" and out.response_ids == ref.response_ids[: first + 1]
    assert len(out.logprobs) == len(out.response_ids) and out.response_ids[-1] == stop


def _server_requests(url: str) -> int:
    """Requests the server holds (running + waiting), from its own /v1/loads (SGLang 0.5.23 entrypoints/v1_loads.py)."""
    loads = http_call(url, "/v1/loads?include=core", timeout=30)["loads"]
    return sum(d["num_running_reqs"] + d["num_waiting_reqs"] for d in loads)


def test_abort_from_another_thread_ends_the_stream_and_the_server_work(engine, server):
    """The abort comes once the server itself holds all 16 requests (not after a fraction of a timed run): each one
    must then end as aborted (the server's finish reason), none run to its LONG tokens, whatever the machine's speed."""
    prompts = [[1, 2 + i] for i in range(16)]
    aborted = engine.metrics["aborted"]
    seen: list[int] = []

    def abort_once_the_server_has_them():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            seen.append(_server_requests(server.url))
            if seen[-1] == len(prompts):
                engine.abort()
                return
            time.sleep(0.05)

    aborter = threading.Thread(target=abort_once_the_server_has_them, daemon=True)
    aborter.start()
    out = list(engine.generate_stream(prompts, SamplingParams(max_new_tokens=LONG), n=1))
    aborter.join(timeout=60)
    assert seen and seen[-1] == len(prompts), f"the server never held all {len(prompts)} requests: {seen[-20:]}"
    assert out == [], "groups aborted mid-flight are not yielded"
    deadline = time.monotonic() + 300  # the stream returns at the abort; its requests' answers come in after it
    while engine._inflight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.metrics["aborted"] - aborted == len(prompts), "every request ended by the abort, none ran to its end"
    # /flush_cache answers 200 once the server is idle (400 if not within the timeout): nothing of them still runs
    http_call(server.url, "/flush_cache?timeout=60", {})
    assert _server_requests(server.url) == 0


def test_stream_then_abort_the_surplus(server):
    engine = make_engine(server, max_concurrency=2)
    try:
        prompts = [[1, 2 + i] for i in range(6)]
        kept = []
        for group in engine.generate_stream(prompts, SamplingParams(max_new_tokens=LONG // 3), n=1):
            kept.append(group[0])
            if len(kept) == 2:
                engine.abort()
                break
        assert all(len(s.response_ids) == LONG // 3 and s.finish_reason == "length" for s in kept)
        assert engine.metrics["requests"] < len(prompts), "requests not yet sent must not be sent after the abort"
        http_call(server.url, "/flush_cache?timeout=10", {})  # the server drains what was running
        again = engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))  # an abort does not poison the engine
        assert again[0].finish_reason == "length"
    finally:
        engine.shutdown(stop_servers=False)


def test_attached_server_is_never_stopped(server):
    attached = SGLangServer.attach(server.url, device="cpu")
    engine = make_engine(attached, max_concurrency=2)
    assert engine.generate([[3]], SamplingParams(max_new_tokens=2))[0].finish_reason == "length"
    engine.shutdown()
    assert server.healthy(), "shutting down an engine must not stop a server it only attached to"
    with pytest.raises(RolloutError, match="attached"):
        attached.start()


def test_dead_server_without_resync_is_refused_not_restarted(model_dir, tmp_path):
    down = cpu_server(model_dir, tmp_path / "never.log")  # never started: refuses connections like a dead one
    engine = make_engine(down, max_concurrency=2)
    engine.set_weight_version(4)
    with pytest.raises(RolloutError, match="stale weights"):
        engine.generate([[1]], SamplingParams(max_new_tokens=2))
    assert down.proc is None, "a server that could not be resynced must not be restarted"


# A server killed mid-rollout is restarted, resynced and its requests re-issued: at the level of a whole DAPO step
# (nothing lost or duplicated, the restarted server serving the trained weights) in
# test_trainer_sglang.py::test_server_killed_mid_rollout_step_completes_nothing_lost_or_duplicated.


def test_deaths_beyond_the_step_limit_stop_naming_node_and_log(server, tmp_path):
    """rollout.max_restarts_per_step = 0: the first death stops the step with one line naming node, URL and log."""
    import socket

    from megatron_dapo.engines.sglang.client import ServerRestartLimit

    engine = make_engine(server, resync=lambda dead: None, max_restarts_per_step=0, max_retries=1)
    try:
        engine.new_step()
        pid, starts = server.pid(), server.starts
        threading.Timer(0.5, os.killpg, (pid, signal.SIGKILL)).start()
        with pytest.raises(ServerRestartLimit) as err:
            engine.generate([[1, 2 + i] for i in range(4)], SamplingParams(max_new_tokens=LONG), n=2)
        msg = str(err.value)
        assert f"rollout server {server.url} on node {socket.gethostname()}" in msg and str(server.log_path) in msg
        assert "rollout.max_restarts_per_step = 0" in msg and server.starts == starts, "no restart beyond the limit"
        engine.max_restarts_per_step = 1
        engine.new_step()  # a new step, a new budget: restarts are allowed again (the next test's server is up)
        out = engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        assert len(out) == 1 and engine.step_restarts == 1 and server.starts == starts + 1
    finally:
        engine.shutdown(stop_servers=False)


def test_wait_timeout_and_early_exit_carry_the_log(model_dir, tmp_path):
    slow = cpu_server(model_dir, tmp_path / "slow.log")
    slow.start()
    pid = slow.pid()
    try:
        with pytest.raises(
            RolloutError, match=r"(?s)not healthy after 3 s \(GET /health\); log .*slow.log.*==== start 1"
        ):
            slow.wait_healthy(timeout=3)  # SGLang takes ~30 s to start
    finally:
        slow.stop()
    assert not alive(pid), "stop() must end the process group it started"
    bad = cpu_server(model_dir, tmp_path / "bad.log", "--no-such-flag")
    bad.start()
    with pytest.raises(RolloutError, match=r"(?s)exited with code 2.*unrecognized arguments: --no-such-flag"):
        bad.wait_healthy(timeout=120)


def test_router_generates_and_weight_sync_goes_to_the_workers(server, tmp_path):
    """sglang-router 0.3.2 (the real one) in front of the worker: /generate through it, updates to the worker. It
    takes the job's key (``--api-key``): requests without it or with another are refused by the router itself (its
    401 has an empty body; the worker's says ``{"error":"Unauthorized"}``), the key's requests reach the worker."""
    from megatron_dapo.actor.dist import free_port
    from megatron_dapo.engines.sglang.auth import api_key

    port = free_port("127.0.0.1")
    log = open(tmp_path / "router.log", "wb")
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", server.url, "--host", "127.0.0.1",
         "--port", str(port), "--worker-startup-check-interval", "1", "--api-key", api_key()],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    engine = make_engine(server, router_url=url, max_concurrency=4, max_retries=1, server_timeout=30)
    try:
        deadline = time.monotonic() + 120
        while not _ready(url):  # the router answers /health at once, /generate once it has checked its worker
            assert router.poll() is None and time.monotonic() < deadline, (tmp_path / "router.log").read_text()[-2000:]
            time.sleep(0.5)
        out = engine.generate([[1, 2], [1, 3]], SamplingParams(max_new_tokens=3), n=2)
        assert len(out) == 4 and all(len(s.response_ids) == 3 for s in out)
        for wrong in ("", "not-the-key"):
            with pytest.raises(ServerRequestError, match=r"HTTP 401: ?$"):  # the router's own refusal
                http_call(url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}, key=wrong)
        report = DiskSync(engine, directory=tmp_path / "w").sync([list(random_weights(ARCH, 6).items())], version=2)
        assert report.verified > 0 and engine.weight_version == 2
        with pytest.raises(ServerRequestError):
            http_call(url, "/begin_weight_update", {})  # the router does not serve weight updates
        os.killpg(router.pid, signal.SIGTERM)
        router.wait(30)
        with pytest.raises(RolloutError, match="no answer"):  # /generate went through the router, not the worker
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    finally:
        engine.shutdown(stop_servers=False)
        if router.poll() is None:
            os.killpg(router.pid, signal.SIGKILL)
        log.close()


def _ready(url: str) -> bool:
    try:
        http_call(url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}, timeout=10)
        return True
    except RolloutError:
        return False
