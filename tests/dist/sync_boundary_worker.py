"""torchrun worker: the trainer's step boundary (collect, train, before_sync, weight sync, weights_updated) on two
gloo ranks, each schedule in turn, through the loop's own ``make_schedule`` and ``make_updates`` (the actor a
stand-in that all-reduces per update). At one sync rank 0 stays in ``before_sync`` for GEN_S seconds, longer than
the default group's collective timeout (DEFAULT_TIMEOUT, what parallel.collective_timeout_s sets):

- one_step_off, async: the producer's batch for step 2, made while step 1 trains, generates for GEN_S (the drain
  waits for it);
- stream, stream_updates: the sync aborts the lanes, and the call of a long sample in flight returns only GEN_S after
  the abort (the lanes' drain is slow, as an abort that reaches a server late);
- sync, partial: nothing generates between steps (the surplus was aborted in next_batch), so rank 0's drain itself
  takes GEN_S, standing for whatever rank 0 does there.

The sync opens with a default-group collective, as the export's gathers do: a rank that skips the meeting waits there
and times out. One JSON record per rank: per mode, ok or the error, and the longest time before_sync held it. A mode
that fails ends the run (a timed-out group cannot go on); the test starts the modes after it anew.

    python -m torch.distributed.run --nproc-per-node=2 sync_boundary_worker.py OUT_DIR MODES DEFAULT_TIMEOUT GEN_S
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from megatron_dapo.algo.sampling import DynamicSampler
from megatron_dapo.engines.base import EngineBase
from megatron_dapo.planning.control_walk import StandInActor, sync_weights, whole_batch_shares
from megatron_dapo.types import Sample, TokenizerInfo
from tests.unit.test_async_schedule import VersionEngine
from tests.unit.test_schedule import TickEngine
from tests.unit.test_schedule import cfg as tick_cfg
from tests.unit.test_schedule import schedule as tick_schedule
from tests.unit.test_stream_schedule import AllRight, Prompts
from tests.unit.test_stream_schedule import cfg as stream_cfg

SLOW_STEP = 2  # one_step_off/async: the batch the producer makes while step 1 trains, in before_sync at the boundary
MODES = {  # mode: config overrides
    "sync": ["rollout.schedule=sync", "rollout.partial=false"],
    "partial": ["rollout.schedule=sync", "rollout.partial=true"],
    "one_step_off": ["rollout.schedule=one_step_off", "rollout.partial=false"],
    "async": ["rollout.schedule=async", "rollout.partial=true"],
    "stream": [],
    "stream_updates": ["train.stream_updates=true", "train.mini_batch_prompts=1", "algo.old_logprobs=rollout"],
}
EOS, TICK, LONG, LONG_PROMPT = 1, 0.005, 100, 5  # stream: prompt 5's samples are LONG tokens, still in flight at step 1


class SlowEngine(TickEngine):
    """The tick engine whose first call for step ``SLOW_STEP``'s batch takes ``gen_s`` seconds."""

    def __init__(self, gen_s: float):
        super().__init__()
        self.gen_s, self.step, self.owner, self.slowed = gen_s, 0, None, False

    def generate_requests(self, requests, sampling):
        step = getattr(self.owner, "next_step", None) or self.step  # async: the step its producer makes a batch for
        if step == SLOW_STEP and not self.slowed:
            self.slowed = True
            time.sleep(self.gen_s)
        yield from super().generate_requests(requests, sampling)

    generate_stream = VersionEngine.generate_stream  # the sync schedule's call, on top of generate_requests


class SlowAbortEngine(EngineBase):
    """Stream lanes: each request decodes a token per TICK; prompt LONG_PROMPT's samples are LONG tokens, the others 3.
    ``abort()`` ends the calls in flight, but the first call it finds running returns only ``gen_s`` later."""

    def __init__(self, gen_s: float):
        self.tokenizer = TokenizerInfo((EOS,), 0, decode=lambda ids: " ".join(map(str, ids)))
        self.gen_s, self._gen, self.slow_abort = gen_s, 0, True
        self.long_running = threading.Event()  # a long sample is in flight: the sync will find it

    def stream_lanes(self):
        return 8, 1

    def generate_requests(self, requests, sampling):
        gen = self._gen
        for i, r in enumerate(requests):
            total, have, ids = LONG if r.input_ids[0] == LONG_PROMPT else 3, len(r.input_ids) - 2, []
            if total == LONG:
                self.long_running.set()
            while have + len(ids) < total and len(ids) < r.max_new_tokens:
                if self._gen != gen:
                    if self.slow_abort:
                        self.slow_abort = False
                        time.sleep(self.gen_s)
                    yield Sample(list(r.input_ids), ids, [-0.5] * len(ids), "abort", prompt_index=i)
                    break
                time.sleep(TICK)
                ids.append(EOS if have + len(ids) == total - 1 else 10)
            else:
                yield Sample(list(r.input_ids), ids, [-0.5] * len(ids), "stop", prompt_index=i)

    def abort(self):
        self._gen += 1


def slow_once(fn, seconds: float):
    """``fn`` whose first call first sleeps ``seconds``."""
    pending = [seconds]

    def call(*args):
        if pending:
            time.sleep(pending.pop())
        return fn(*args)

    return call


def make_mode(mode: str, gen_s: float):
    """(config, schedule, engine) of ``mode`` on this rank; only rank 0's schedule holds the engine."""
    from megatron_dapo.loop.schedule import make_schedule

    driver = dist.get_rank() == 0
    if mode.startswith("stream"):
        c = stream_cfg("train.steps=2", *MODES[mode])
        engine = SlowAbortEngine(gen_s)
        s = make_schedule(c, engine if driver else None, Prompts(), DynamicSampler(4, 0, enabled=False), AllRight())
        return c, s, engine
    c = tick_cfg(*MODES[mode], "rollout.colocate=false", "train.steps=2")
    engine = SlowEngine(gen_s)
    s = tick_schedule(c, engine)
    engine.owner = s
    for owner in (s, getattr(s, "inner", s)):
        owner.engine = engine if driver else None
    if mode in ("sync", "partial"):
        engine.slowed = True  # nothing generates at the boundary: rank 0's drain is what takes long
        if driver:
            s._drain = slow_once(s._drain, gen_s)
    return c, s, engine


def run_mode(mode: str, gen_s: float) -> float:
    """The trainer's calls over 2 steps; the longest before_sync on this rank (s)."""
    from megatron_dapo.loop.updates import make_updates

    c, s, engine = make_mode(mode, gen_s)
    updates = make_updates(c, s, StandInActor([[0], [1]], c.num_updates))
    held = 0.0
    try:
        s.weights_updated(0)
        for step in (1, 2):
            engine.step = step
            seqs, _ = updates.collect(step)  # scatter_batch: over the control plane
            updates.train(seqs)  # every rank: the default group
            if step == 1 and dist.get_rank() == 0 and hasattr(engine, "long_running"):
                assert engine.long_running.wait(10), "no long sample in flight at the sync: the test checks nothing"
            t0 = time.monotonic()
            s.before_sync()
            held = max(held, time.monotonic() - t0)
            sync_weights(None, step)  # the export's default-group gathers, then rank 0's engine update
            s.weights_updated(step)
    finally:
        s.close()
    return held


def main(out: str, modes: str, default_timeout: float, gen_s: float) -> None:
    from megatron_dapo.actor import shares
    from megatron_dapo.loop.control import set_control_timeout

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=default_timeout))  # NCCL's role on a GPU
    rank = dist.get_rank()
    set_control_timeout(default_timeout * 10)  # sized to a rollout, not to the default collective timeout
    shares.dp_shares = whole_batch_shares  # the stand-in actor: each DP rank is sent the batch whole
    record: dict = {"rank": rank, "modes": {}}
    try:
        for mode in modes.split(","):
            record["modes"][mode] = {"ok": False}
            t0 = time.monotonic()
            held = run_mode(mode, gen_s)
            record["modes"][mode] = {"ok": True, "before_sync_s": held, "seconds": time.monotonic() - t0}
    except Exception as e:
        message = re.sub(r"\[[^\]]*\.cc:\d+\] ", "", str(e))  # gloo's source paths out
        record["modes"][mode]["error"] = f"{type(e).__name__}: {message[:200]}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    sys.stdout.flush()
    os._exit(0)  # a group that timed out cannot be torn down cleanly: leave without its collectives


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
