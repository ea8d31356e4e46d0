"""What the REAL SGLang 0.5.23 CPU server (the session's) answers for a request aborted one decode step before it
emits a stop token: an abort sets ``to_finish`` and the request still runs one decode step (srt/managers/scheduler.py
``abort_request``), whose token ``update_finish_state`` never checks against the stop tokens (schedule_batch.py: the
``to_finish`` branch returns first). The sample comes back ``abort`` ending in its stop token; partial rollout
(``PartialSchedule._extend``) must count it finished, not resume it past its end."""

from __future__ import annotations

import concurrent.futures as cf
import random
import time

import pytest

from megatron_dapo.engines.sglang.server import http_call
from megatron_dapo.loop.schedule import Slot
from megatron_dapo.types import Sample, SamplingParams
from tests.unit.test_schedule import cfg, schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
VOCAB = 64  # the tiny model's vocabulary as SGLang pads it
BLOCKER = 477  # prompt tokens prefilled 8 a step (the server's --chunked-prefill-size); decode waits meanwhile


def _generate(url: str, ids: list[int], max_new: int, stop: list[int] | None = None) -> tuple[list[int], str]:
    sp = {"max_new_tokens": max_new, "temperature": 0.0, **({"stop_token_ids": stop} if stop else {})}
    out = http_call(url, "/generate", {"input_ids": ids, "sampling_params": sp}, timeout=120)
    return list(out["output_ids"]), out["meta_info"]["finish_reason"]["type"]


def test_an_abort_one_step_before_a_stop_token_comes_back_abort_ending_in_it(engine, server):
    url, rng = server.url, random.Random(0)
    for _ in range(50):  # a short prompt whose greedy answer starts with two different tokens
        prompt = [rng.randrange(3, 32) for _ in range(4)]
        ids, reason = _generate(url, prompt, 2)
        if reason == "length" and len(set(ids)) == 2:
            break
    t1, t2 = ids
    stop = [t for t in range(VOCAB) if t != t1]  # every token but t1 ends it: greedy, it stops at t2 (its second)

    def blocker() -> list[int]:  # a fresh prompt each time: no radix-cache hit, its whole prefill in chunks
        return [rng.randrange(3, 32) for _ in range(BLOCKER)]

    # Blockers ahead of R prefill in chunks first (fcfs); R (prompt cached) prefills after them and gets t1, then waits
    # for its decode step while the blockers sent after it prefill ("Run prefill first if possible": scheduler.py
    # get_next_batch_to_run). The abort, sent once the blockers ahead have answered, lands there: R decodes once more,
    # emits t2 (a stop token), and is reported aborted.
    outcomes = []
    with cf.ThreadPoolExecutor(9) as pool:
        for delay in (0.0, 0.02, 0.05, 0.1, 0.2):
            ahead = [pool.submit(_generate, url, blocker(), 1) for _ in range(2)]
            time.sleep(0.02)
            r = pool.submit(_generate, url, prompt, 4, stop)
            time.sleep(0.02)
            behind = [pool.submit(_generate, url, blocker(), 1) for _ in range(6)]
            for f in ahead:
                f.result()
            time.sleep(delay)
            http_call(url, "/abort_request", {"abort_all": True})
            ids, reason = r.result()
            outcomes.append((delay, reason, ids, [f.result()[1] for f in behind]))
            if reason == "abort" and ids == [t1, t2]:
                break
    assert reason == "abort" and ids == [t1, t2], (t1, t2, outcomes)
    # the schedule's side: the sample has ended (a stop token last): judged, never resumed past it
    partial = schedule(cfg(), engine)
    slot = Slot()
    partial._extend(slot, Sample(prompt, ids, [0.0] * len(ids), reason), 4, partial._stop_ids(SamplingParams(
        stop_token_ids=tuple(stop))))  # fmt: skip
    assert slot.finished and slot.finish_reason == "stop" and slot.response_ids == [t1, t2]
