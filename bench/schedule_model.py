"""A MODEL, not a measurement: RL rollout schedules as a discrete-event simulation, calibrated on measured phase times.

    .venv/bin/python bench/schedule_model.py bench/settings/verl_7b_h20_128.yaml [--steps 8] [--seed 0]

The successor of ``bench/sim_schedule.py`` (which charged training at a fixed MFU, linear in GPU count, and drove the
producer batch by batch). Its assumptions are written out in ``docs/schedule-model.md``; every number it uses comes
from a setting file (``bench/settings/*.yaml``), each with its source or marked ASSUMPTION.

What it simulates, per sample:
- Engines (one per ``engine_gpus`` GPUs) decode with continuous batching, ``slots`` samples at most; a decode step
  costs k·(weights + KV bytes of every running sample's context): memory-bound decode. The ratio of the two terms comes
  from the model's sizes; k is CALIBRATED so that the colocated layout's simulated generation of one batch takes the
  measured ``colocated.gen_s``. Prefill is not modelled.
- A producer admits samples to engines: ``stream`` keeps engines full across batch boundaries up to the staleness
  bound (prompts started ≤ (syncs + 1 + staleness) × prompts per sync: verl's staleness_threshold, a fraction), or
  ``batch`` (megatron-dapo's schedules before streaming: one batch at a time, each drained before the next, at most
  ``depth`` batches ahead of the trainer). Dispatch: ``least_loaded`` or ``fill_first`` (the lowest engine with room).
- The trainer takes ``chunk_prompts`` complete groups (in ``completion`` or ``prompt`` order) as soon as they are in
  (streaming training; chunk = the whole batch for non-streaming) and trains them in the measured time for its GPU
  count (``train_s_by_gpus``, interpolated log-log between measured points: not linear in GPUs), plus the π_old
  forward (``old_logprob_s_by_gpus``) unless ``old_logprobs: rollout``.
- Every ``sync_every`` chunks the weights are synced (``sync_s``): ``interrupt`` aborts every in-flight sample, which
  keeps its tokens and resumes after the sync with the budget it has left; ``wait`` stops admitting and waits for the
  samples in flight to finish first.
Colocated (``split: 0``): generate the batch on every GPU, then π_old, train, ``other_s`` and sync, one after another.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import heapq
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_schedule import Engine  # noqa: E402  (continuous batching in closed form)


@dataclass
class Case:
    name: str
    split: int | str = 0  # rollout GPUs; 0 = colocated on all; "search" = the best whole-node split
    producer: str = "stream"  # stream | batch
    depth: int = 1  # batch producer: batches ahead of the trainer (one_step_off 1, async max_staleness)
    staleness: float = 0.0  # stream producer: the fraction of a sync period's prompts that may start early
    sync: str = "wait"  # wait | interrupt
    sync_every: int = 1  # trainer chunks between weight syncs
    chunk_prompts: int = 0  # prompts per trainer chunk; 0 = the whole batch (no streaming training)
    order: str = "completion"  # completion | prompt: which complete groups the trainer may take
    dispatch: str = "least_loaded"  # least_loaded | fill_first
    old_logprobs: str = "recompute"  # recompute | rollout (no π_old forward)
    measured_step_s: float | None = None  # the published number this case reproduces, if any


@dataclass
class Setting:
    name: str
    source: str
    gpus: int
    batch_prompts: int
    group_size: int
    prompt_len: int
    max_response: int
    lengths: dict  # lognormal: mean, sigma, at_cap (fraction at max_response)
    engine_gpus: int
    slots: int
    weight_gb: float
    kv_kb_per_token: float
    colocated: dict  # gen_s, old_logprob_s, train_s, other_s on all gpus
    train_s_by_gpus: dict
    old_logprob_s_by_gpus: dict
    sync_s: float
    cases: list[Case] = field(default_factory=list)
    gpus_per_node: int = 8  # split: search tries whole nodes
    informative: float = 1.0  # the share of groups dynamic sampling keeps (1 = no filtering)
    # decode cost per GB read per step, from hardware; null = calibrated on colocated.gen_s
    decode_s_per_gb: float | None = None

    @classmethod
    def load(cls, path: str | Path) -> Setting:
        raw = yaml.safe_load(Path(path).read_text())
        cases = [Case(**c) for c in raw.pop("cases", [])]
        optional = {"cases", "gpus_per_node", "informative", "decode_s_per_gb"}
        missing = set(cls.__dataclass_fields__) - set(raw) - optional
        if missing:
            raise ValueError(f"{path}: missing {sorted(missing)}")
        return cls(**raw, cases=cases)


def draw_length(s: Setting, rng: random.Random) -> int:
    if rng.random() < s.lengths["at_cap"]:
        return s.max_response
    sigma = s.lengths["sigma"]
    mu = math.log(s.lengths["mean"]) - sigma**2 / 2
    return max(1, min(s.max_response, int(rng.lognormvariate(mu, sigma))))


def interpolate(points: dict, gpus: int) -> float:
    """Measured seconds at GPU counts, log-log between the nearest two (flat beyond the ends)."""
    xs = sorted(int(k) for k in points)
    if gpus <= xs[0]:
        return float(points[xs[0]])
    if gpus >= xs[-1]:
        return float(points[xs[-1]])
    i = bisect.bisect_left(xs, gpus)
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = float(points[x0]), float(points[x1])
    f = (math.log(gpus) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))


# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class Smp:
    group: int
    length: int
    done: int = 0
    versions: set = field(default_factory=set)
    engine: int = -1


class Sim:
    """One case of one setting on ``engines`` engines; ``k`` s/GB the calibrated decode cost."""

    def __init__(self, s: Setting, case: Case, k: float, seed: int):
        self.s, self.c, self.rng = s, case, random.Random(seed)
        self.G = s.group_size
        rollout_gpus = case.split or s.gpus
        self.train_gpus = s.gpus - case.split if case.split else s.gpus
        n = max(1, rollout_gpus // s.engine_gpus)
        a, c = k * s.weight_gb, k * s.kv_kb_per_token * 1e-6
        self.engines = [Engine(a, c, s.slots) for _ in range(n)]
        for e in self.engines:
            e.epoch = 0
        self.samples: list[Smp] = []
        self.group_left: list[int] = []
        self.informative: list[bool] = []
        self.queue_resume: list[int] = []  # aborted samples, resumed first (prompt order)
        self.next_prompt = 0
        self.version = 0
        self.events: list = []
        self.seq = 0
        self.t = 0.0
        self.ctx0: dict[int, int] = {}
        self.busy_engine_s = 0.0
        self.busy_since: dict[int, float] = {}

    # -- engines -------------------------------------------------------------------------------------------------
    def _push(self, ei: int) -> None:
        e = self.engines[ei]
        nf = e.next_finish()
        if nf is not None:
            self.seq += 1
            heapq.heappush(self.events, (e.t + e.time_for(nf - e.n), self.seq, "engine", (ei, e.epoch, nf)))

    def _advance_to(self, e: Engine, t: float) -> None:
        """Move a running engine's clock to ``t`` without crossing its next finish (admission mid-run)."""
        if not e.running:
            e.t, e.n = t, e.n
            return
        k = e.steps_by(t)
        nf = e.next_finish()
        k = min(k, max(0, nf - e.n - 1)) if nf is not None else k
        e.t, e.n = e.t + e.time_for(k), e.n + k

    def _admit(self, sid: int, t: float) -> bool:
        room = [i for i, e in enumerate(self.engines) if len(e.running) < e.slots]
        if not room:
            return False
        if self.c.dispatch == "least_loaded":
            ei = min(room, key=lambda i: (len(self.engines[i].running), i))
        else:
            ei = room[0]
        e = self.engines[ei]
        if not e.running:
            e.t, e.n, e.k_sum, e.finishes = t, 0, 0, []
            self.busy_since[ei] = t
        else:
            self._advance_to(e, t)
        smp = self.samples[sid]
        self.ctx0[sid] = self.s.prompt_len + smp.done
        e.admit(sid, self.ctx0[sid], smp.length - smp.done)
        smp.engine = ei
        smp.versions.add(self.version)
        e.epoch += 1
        self._push(ei)
        return True

    def _new_group(self) -> None:
        g = len(self.group_left)
        self.group_left.append(self.G)
        self.informative.append(self.rng.random() < self.s.informative)  # dynamic sampling keeps it
        for _ in range(self.G):
            self.samples.append(Smp(g, draw_length(self.s, self.rng)))

    def prompts_allowed(self) -> int:
        c, P = self.c, self.period_prompts
        if c.producer == "stream":
            return int((self.version + 1 + c.staleness) * P)
        # batch by batch: the next batch only once the previous one is complete, at most depth ahead of the trainer
        started_batches = self.next_prompt // P
        if started_batches and any(self.group_left[g] for g in range((started_batches - 1) * P, started_batches * P)):
            return self.next_prompt
        return min((self.version + 1 + c.depth) * P, (started_batches + 1) * P)  # batch j on version >= j - 1 - depth

    def fill(self, t: float) -> None:
        if self.draining or self.in_sync:
            return
        while self.queue_resume:
            if not self._admit(self.queue_resume[0], t):
                return
            self.queue_resume.pop(0)
        while self.next_prompt < self.prompts_allowed():
            if not any(len(e.running) < e.slots for e in self.engines):
                return
            if self.next_prompt >= len(self.group_left):
                self._new_group()
            g = self.next_prompt
            for sid in range(g * self.G, (g + 1) * self.G):
                if not self._admit(sid, t):
                    self.queue_resume.append(sid)  # no room for the whole group: the rest waits
            self.next_prompt += 1

    def _finish(self, ei: int, t: float) -> None:
        e = self.engines[ei]
        e.t = t
        for sid in e.pop_finished(self.ctx0):
            smp = self.samples[sid]
            smp.done, smp.engine = smp.length, -1
            self.group_left[smp.group] -= 1
            if self.group_left[smp.group] == 0 and self.informative[smp.group]:
                self.complete.append(smp.group)
        if not e.running:
            self.busy_engine_s += t - self.busy_since.pop(ei, t)
        e.epoch += 1
        self._push(ei)

    def interrupt(self, t: float) -> None:
        """Abort every in-flight sample: it keeps its tokens and resumes after the sync."""
        aborted = []
        for ei, e in enumerate(self.engines):
            if not e.running:
                continue
            k = e.steps_by(t)
            nf = e.next_finish()
            k = min(k, nf - e.n) if nf is not None else k
            for sid, s0 in e.running.items():
                self.samples[sid].done = min(self.samples[sid].length - 1, self.samples[sid].done + e.n + k - s0)
                aborted.append(sid)
            e.running, e.finishes, e.k_sum = {}, [], 0
            e.epoch += 1
            self.busy_engine_s += t - self.busy_since.pop(ei, t)
        self.queue_resume = sorted(aborted + self.queue_resume)

    # -- the run -------------------------------------------------------------------------------------------------
    def run(self, steps: int) -> dict:
        s, c = self.s, self.c
        chunk = c.chunk_prompts or s.batch_prompts
        # prompts generated per sync period (dynamic sampling drops some): the staleness bound's unit
        self.period_prompts = math.ceil(c.sync_every * chunk / s.informative)
        per_chunk = chunk / s.batch_prompts
        train_s = interpolate(s.train_s_by_gpus, self.train_gpus) * per_chunk
        if c.old_logprobs == "recompute":
            train_s += interpolate(s.old_logprob_s_by_gpus, self.train_gpus) * per_chunk
        self.complete: list[int] = []
        taken: set[int] = set()
        prompt_ptr = 0
        self.draining = self.in_sync = False
        trainer_busy, trainer_free_at, chunks = 0.0, 0.0, 0
        stale, spans, partial = 0, [], 0
        self.fill(0.0)

        def try_train(t: float) -> None:
            nonlocal prompt_ptr, trainer_busy, trainer_free_at
            if self.in_sync or self.draining or trainer_free_at > t or self.pending_sync:
                return
            if c.order == "prompt":  # the complete prefix in prompt order, the groups dynamic sampling drops skipped
                avail, ptr = [], prompt_ptr
                while ptr < len(self.group_left) and self.group_left[ptr] == 0 and len(avail) < chunk:
                    if self.informative[ptr]:
                        avail.append(ptr)
                    ptr += 1
                if len(avail) < chunk:
                    return
                prompt_ptr = ptr
            else:
                fresh = [g for g in self.complete if g not in taken]
                if len(fresh) < chunk:
                    return
                avail = fresh[:chunk]
            taken.update(avail)
            self.trained_groups += avail
            trainer_busy += train_s
            trainer_free_at = t + train_s
            self.seq += 1
            heapq.heappush(self.events, (trainer_free_at, self.seq, "trained", None))

        self.pending_sync = False
        self.trained_groups: list[int] = []
        t = 0.0
        batch_times = [0.0]
        while len(batch_times) <= steps and self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if kind == "engine":
                ei, epoch, nf = payload
                e = self.engines[ei]
                if e.epoch != epoch:
                    continue
                e.n = nf
                self._finish(ei, t)
                self.fill(t)
            elif kind == "trained":
                chunks += 1
                if len(self.trained_groups) // s.batch_prompts > len(batch_times) - 1:
                    batch_times.append(t)  # a batch's worth of groups trained
                if chunks % c.sync_every == 0:
                    self.pending_sync = True
                    if c.sync == "interrupt":
                        self.interrupt(t)
                        self._start_sync(t)
                    else:
                        self.draining = True
            elif kind == "synced":
                self.in_sync = self.pending_sync = False
                self.version += 1
                self.fill(t)
            if self.draining and not any(e.running for e in self.engines):
                self.draining = False
                self._start_sync(t)
            try_train(t)
        for g in self.trained_groups:
            vs = set().union(*(self.samples[sid].versions for sid in range(g * self.G, (g + 1) * self.G)))
            spans.append(max(vs) - min(vs))
            partial += sum(len(self.samples[sid].versions) > 1 for sid in range(g * self.G, (g + 1) * self.G))
            stale += self.G * (min(vs) < max(vs))
        steady = [b - a for a, b in zip(batch_times, batch_times[1:])][1:] or [batch_times[-1]]
        total = batch_times[-1]
        n_trained = len(self.trained_groups) * self.G
        return {
            "step_s": sum(steady) / len(steady),
            "trainer_idle": 1 - trainer_busy / total if total else 0.0,
            "rollout_idle": 1 - self.busy_engine_s / (len(self.engines) * total) if total else 0.0,
            "partial_ratio": partial / max(1, n_trained),
            "max_partial_span": max(spans, default=0),
            "stale_group_frac": stale / max(1, n_trained),
        }

    def _start_sync(self, t: float) -> None:
        self.in_sync = True
        self.seq += 1
        heapq.heappush(self.events, (t + self.s.sync_s, self.seq, "synced", None))


def colocated_gen_s(s: Setting, k: float, seed: int, steps: int = 3) -> float:
    """One batch generated on every GPU from empty engines (the colocated rollout phase), mean over ``steps``."""
    rng, times = random.Random(seed), []
    n = s.gpus // s.engine_gpus
    a, c = k * s.weight_gb, k * s.kv_kb_per_token * 1e-6
    for _ in range(steps):
        engines = [Engine(a, c, s.slots) for _ in range(n)]
        lengths = [draw_length(s, rng) for _ in range(math.ceil(s.batch_prompts / s.informative) * s.group_size)]
        ctx0: dict[int, int] = {}
        events: list = []
        per = [list(range(i, len(lengths), n)) for i in range(n)]  # the batch split evenly over the engines
        for ei, sids in enumerate(per):
            e = engines[ei]
            for sid in sids[: e.slots]:
                ctx0[sid] = s.prompt_len
                e.admit(sid, s.prompt_len, lengths[sid])
            queue_e = sids[e.slots :][::-1]
            e.queue = queue_e
            nf = e.next_finish()
            if nf is not None:
                heapq.heappush(events, (e.t + e.time_for(nf - e.n), ei, nf))
        end = 0.0
        while events:
            t, ei, nf = heapq.heappop(events)
            e = engines[ei]
            e.t, e.n = t, nf
            e.pop_finished(ctx0)
            while e.queue and len(e.running) < e.slots:
                sid = e.queue.pop()
                ctx0[sid] = s.prompt_len
                e.admit(sid, s.prompt_len, lengths[sid])
            end = max(end, t)
            nf = e.next_finish()
            if nf is not None:
                heapq.heappush(events, (e.t + e.time_for(nf - e.n), ei, nf))
        times.append(end)
    return sum(times) / len(times)


def calibrate(s: Setting, seed: int = 0) -> float:
    """k (s per GB read per decode step) such that the colocated generation takes the measured ``colocated.gen_s``;
    every engine time is linear in k. A setting without a measured generation gives k from hardware."""
    if s.decode_s_per_gb is not None:
        return s.decode_s_per_gb
    return s.colocated["gen_s"] / colocated_gen_s(s, 1.0, seed)


def predict(s: Setting, case: Case, k: float, steps: int = 8, seed: int = 0) -> dict:
    if case.split == "search":  # whole nodes of rollout, the rest training: the fastest
        rows = []
        lo = min(int(g) for g in s.train_s_by_gpus)  # trainers smaller than the smallest estimate: not modelled
        for nodes in range(1, (s.gpus - lo) // s.gpus_per_node + 1):
            r = predict(s, dataclasses.replace(case, split=nodes * s.gpus_per_node), k, steps, seed)
            rows.append({**r, "split": nodes * s.gpus_per_node})
        return min(rows, key=lambda r: r["step_s"])
    if not case.split:  # colocated: one phase after the other
        gen = colocated_gen_s(s, k, seed)
        col = s.colocated
        old = 0.0 if case.old_logprobs == "rollout" else col["old_logprob_s"]
        step = gen + old + col["train_s"] + col["other_s"] + s.sync_s
        return {"step_s": step, "trainer_idle": gen / step, "rollout_idle": 1 - gen / step, "partial_ratio": 0.0,
                "max_partial_span": 0, "stale_group_frac": 0.0, "split": 0}  # fmt: skip
    return {**Sim(s, case, k, seed).run(steps), "split": case.split}


def report(s: Setting, steps: int, seed: int) -> str:
    k = calibrate(s, seed)
    lines = [
        f"# MODEL (not a measurement): {s.name}",
        "",
        f"Source: {s.source}. Decode cost k = {k * 1e3:.4f} ms per GB read per step ("
        + (
            "from hardware"
            if s.decode_s_per_gb is not None
            else f"calibrated: the colocated generation takes the measured {s.colocated['gen_s']} s"
        )
        + f"). {steps} batches, seed {seed}.",
        "",
        "| case | split | step (s) | measured (s) | error | trainer idle | rollout idle | partial | max span |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in s.cases:
        r = predict(s, case, k, steps, seed)
        m = case.measured_step_s
        err = f"{(r['step_s'] - m) / m:+.0%}" if m else ""
        split = f"{r['split']}:{s.gpus - r['split']}" if r["split"] else f"colocated {s.gpus}"
        lines.append(
            f"| {case.name} | {split} | {r['step_s']:.1f} | {m or ''} | {err} | {r['trainer_idle']:.2f} | "
            f"{r['rollout_idle']:.2f} | {r['partial_ratio']:.2f} | {r['max_partial_span']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("setting", help="a setting file, e.g. bench/settings/verl_7b_h20_128.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(report(Setting.load(args.setting), args.steps, args.seed))


if __name__ == "__main__":
    main()
