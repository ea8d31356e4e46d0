"""A PROJECTION, not a measurement: a discrete-event model of DAPO rollout schedules on a 16-node x 8-GPU layout.

    .venv/bin/python bench/sim_schedule.py [--steps 6] [--seed 0] [--lengths dapo|FILE.json] [--out bench/results]

It replays a response-length distribution through SGLang-like engines (continuous batching, a fixed number of slots
per engine, memory-bound decode) and through the trainer, for the four ``rollout.schedule`` / ``rollout.partial``
modes as megatron-dapo implements them (loop/schedule.py, loop/async_schedule.py):

- ``sync``: engines and trainer colocated on all GPUs, one after the other; generate until B informative groups are
  in (dynamic sampling, cut in prompt order), abort the surplus and drop it.
- ``partial``: the same, the surplus aborted but kept and resumed first next step with the budget it has left.
- ``one_step_off``: engines on R GPUs, trainer on the rest; step k+1's batch is generated while step k trains; the
  weight sync waits for it (the boundary).
- ``async``: the same producer running up to ``max_staleness`` (2) batches ahead; the sync waits only for the batch
  in progress.

The split R is searched per mode over whole nodes (the best is reported). Every input is a field of ``Inputs`` below
with its source; the output repeats them. Assumptions are labelled as such: no number here was measured on a GPU.

Inputs and where they come from
- Response lengths (``--lengths dapo``): lognormal, mean 4,500 tokens, clipped at 20,480 with 3% of samples at the
  cap. DAPO (Yu et al. 2025, arXiv:2503.14476): max response 16,384 + 4,096 overlong buffer = 20,480 tokens; its
  training-dynamics figure shows the mean response length growing to ~4-5k tokens. The shape (lognormal, sigma 0.9)
  and the 3% at the cap are ASSUMPTIONS (the paper gives no per-sample distribution). ``--lengths FILE.json``: a list
  of measured response lengths (e.g. from a run's rollout dump) replaces it, scaled to the same cap.
- Batch: B = 512 prompts x G = 16 samples, gen batch 1,536 prompts (DAPO paper; recipes/dapo_32b.yaml); a group is
  informative (not all correct / all wrong) with probability 0.6: ASSUMPTION (DAPO's dynamic sampling drops the rest).
- Model: Qwen2.5-32B, 32.5e9 parameters, 64 layers, 8 KV heads x 128 dims (its config.json): 262 KB of bf16 KV cache
  per token, 65 GB of bf16 weights.
- GPU: H100 SXM 80 GB, 3.35 TB/s HBM3, 989 TFLOP/s dense bf16 (NVIDIA datasheet). Decode at 70% of the memory
  bandwidth and training at 40% MFU: ASSUMPTIONS. One decode step of an engine (TP 4) reads its weights once and the
  KV cache of every running sample: tau = (weights + kv_bytes * context) / (TP * 3.35e12 * 0.7).
- Engine slots: 128 concurrent samples per TP-4 engine (KV room: 4 x 80 GB x 0.85 - 65 GB ~ 207 GB ~ 790k tokens,
  ~150 samples at 5k context): DERIVED from the above, rounded down.
- Training: 8 N FLOPs per token (6 N forward + backward, 2 N the pi_old forward): ASSUMPTION (megatron-dapo reuses
  the first mini-batch's forward, so it is at most this).
- Weight sync: 65 GB at 10 GB/s = 6.5 s (ASSUMPTION; bench_bridge / weight_sync have no GPU number yet).
- Measured on CPU (bench/results/schedule-2026-12-01.md, chain task, HF engine): rollout ~1/3 of a step there;
  NOT an input here (a 2-core CPU says nothing about H100 decode), quoted so the two are not confused.
- Check against a published number (printed): sync's rollout share of the step vs ~70% for DAPO-32B (verl's
  one-step-off docs, quoted in issue 24).

Not modelled: prefill, the colocated memory hand-over (release/resume, seconds), eval and checkpoint time, stragglers
between engines beyond the lengths, the learning effect of staleness (only throughput is projected).
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass
class Inputs:
    nodes: int = 16  # the layout the issue asks about
    gpus_per_node: int = 8
    tp: int = 4  # rollout TP per engine (recipes/dapo_32b.yaml: rollout.sglang.tp)
    slots: int = 128  # concurrent samples per engine (derived, see the docstring)
    batch_prompts: int = 512  # DAPO paper
    group_size: int = 16  # DAPO paper
    gen_batch_prompts: int = 1536  # DAPO paper (3 x B)
    informative_p: float = 0.6  # ASSUMPTION
    prompt_len: int = 300  # ASSUMPTION (math prompts with the DAPO template)
    mean_len: float = 4500.0  # DAPO paper (training-dynamics figure, late in training)
    max_len: int = 20480  # DAPO paper (16,384 + 4,096 overlong buffer)
    at_cap: float = 0.03  # ASSUMPTION
    sigma: float = 0.9  # ASSUMPTION (lognormal shape)
    params: float = 32.5e9  # Qwen2.5-32B
    weight_bytes: float = 65e9  # bf16
    kv_bytes_per_token: float = 262144.0  # 64 layers x 8 KV heads x 128 x 2 (k, v) x 2 bytes
    hbm_bw: float = 3.35e12  # H100 SXM datasheet
    decode_eff: float = 0.7  # ASSUMPTION
    peak_flops: float = 989e12  # H100 SXM dense bf16
    mfu: float = 0.4  # ASSUMPTION
    train_flops_per_token: float = 8.0  # x params, ASSUMPTION
    sync_s: float = 6.5  # ASSUMPTION (65 GB at 10 GB/s)
    max_staleness: int = 2  # async (rollout.max_staleness default)
    lengths: list[int] = field(default_factory=list)  # measured lengths (--lengths FILE); empty = the lognormal

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def draw_length(inp: Inputs, rng: random.Random) -> int:
    """A response length: a measured one (scaled to the cap) or the DAPO-shaped lognormal, clipped at the cap."""
    if inp.lengths:
        return max(1, min(inp.max_len, rng.choice(inp.lengths)))
    if rng.random() < inp.at_cap:
        return inp.max_len
    mu = math.log(inp.mean_len) - inp.sigma**2 / 2  # the lognormal's mean is mean_len before the clip
    return max(1, min(inp.max_len, int(rng.lognormvariate(mu, inp.sigma))))


# ----------------------------------------------------------------------------------------------------------------------
# Engines: continuous batching, one token per running sample per decode step


class Engine:
    """A decode step costs a + c * (total context of the running samples). Between events the running set is fixed,
    so the time of k steps has a closed form."""

    def __init__(self, a: float, c: float, slots: int):
        self.a, self.c, self.slots = a, c, slots
        self.t, self.n = 0.0, 0  # clock (s), decode steps done
        self.running: dict[int, int] = {}  # sample id -> start step
        self.finishes: list[tuple[int, int]] = []  # heap of (finish step, sample id)
        self.k_sum = 0  # sum over running of (context at start − start step): context(n) = b * n + k_sum

    def time_for(self, k: int) -> float:
        b = len(self.running)
        return k * self.a + self.c * (b * (k * self.n + k * (k - 1) / 2) + k * self.k_sum)

    def next_finish(self) -> int | None:
        return self.finishes[0][0] if self.finishes else None

    def steps_by(self, t: float) -> int:
        """Decode steps done by time ``t`` (for an abort between events)."""
        lo, hi = 0, max(0, (self.next_finish() or self.n) - self.n)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.t + self.time_for(mid) <= t else (lo, mid - 1)
        return lo

    def admit(self, sid: int, context: int, tokens: int) -> None:
        self.running[sid] = self.n
        heapq.heappush(self.finishes, (self.n + tokens, sid))
        self.k_sum += context - self.n

    def pop_finished(self, ctx0: dict[int, int]) -> list[int]:
        out = []
        while self.finishes and self.finishes[0][0] == self.n:
            _, sid = heapq.heappop(self.finishes)
            self.k_sum -= ctx0[sid] - self.running.pop(sid)
            out.append(sid)
        return out


@dataclass
class Sample:
    group: int
    length: int  # total response tokens it will have
    done: int = 0  # generated so far (carried)
    version: int = 0  # the weights its first token came from


def rollout_batches(inp: Inputs, engines: int, steps: int, carry: bool, seed: int) -> list[dict]:
    """Each step's batch generated on ``engines`` engines, one batch after the other (as in every mode):
    its generation time, trained tokens and trained samples' lags (carried samples)."""
    rng = random.Random(seed)
    a = inp.weight_bytes / (inp.tp * inp.hbm_bw * inp.decode_eff)
    c = inp.kv_bytes_per_token / (inp.tp * inp.hbm_bw * inp.decode_eff)
    G, out, carried, gid = inp.group_size, [], [], 0  # carried: groups [(informative, [Sample])]
    for step in range(1, steps + 1):
        eng = [Engine(a, c, inp.slots) for _ in range(engines)]
        kept, gen_time = [], 0.0
        while len(kept) < inp.batch_prompts:
            groups, carried = carried, []
            for _ in range(max(0, inp.gen_batch_prompts - len(groups))):
                groups.append((rng.random() < inp.informative_p,
                               [Sample(gid, draw_length(inp, rng), version=step) for _ in range(G)]))  # fmt: skip
                gid += 1
            t, cut, surplus = _round(inp, eng, groups, inp.batch_prompts - len(kept), gen_time)
            kept += [g for g in groups[:cut] if g[0]]
            gen_time = t
            carried = surplus if carry else []  # sync: the surplus is dropped
        tokens = sum(inp.prompt_len + s.length for _, ss in kept for s in ss)
        lag = [step - s.version for _, ss in kept for s in ss]
        out.append({"gen_s": gen_time, "train_tokens": tokens, "samples": len(kept) * G,
                    "carried_frac": sum(x > 0 for x in lag) / len(lag)})  # fmt: skip
    return out


def _round(inp: Inputs, eng: list[Engine], groups: list, missing: int, t0: float):
    """One generation round from time ``t0``: samples in group order to free slots; the cut comes when the first
    ``missing`` informative groups in group order are complete. Returns (time of the cut, groups before the cut,
    the groups after it with their samples' progress)."""
    G = inp.group_size
    queue = [(gi, j) for gi, (_, ss) in enumerate(groups) for j in range(G) if ss[j].done < ss[j].length]
    queue.reverse()
    left = [sum(s.done < s.length for s in ss) for _, ss in groups]  # unfinished samples per group
    for e in eng:
        e.t, e.n, e.running, e.finishes, e.k_sum = t0, 0, {}, [], 0
    events: list = []
    ctx0: dict[int, int] = {}

    def fill(ei: int) -> None:
        e = eng[ei]
        while queue and len(e.running) < e.slots:
            gi, j = queue.pop()
            s = groups[gi][1][j]
            sid = gi * G + j
            ctx0[sid] = inp.prompt_len + s.done
            e.admit(sid, ctx0[sid], s.length - s.done)
        nf = e.next_finish()
        if nf is not None:
            heapq.heappush(events, (e.t + e.time_for(nf - e.n), ei, nf))

    for ei in range(len(eng)):
        fill(ei)
    ptr, found, t = 0, 0, t0

    def advance() -> bool:  # the prompt-order cut: complete groups from ptr on, counting the informative ones
        nonlocal ptr, found
        while ptr < len(groups) and left[ptr] == 0:
            found += groups[ptr][0]
            ptr += 1
            if found >= missing:
                return True
        return False

    if advance():
        return t, ptr, groups[ptr:]
    while events:
        t, ei, nf = heapq.heappop(events)
        e = eng[ei]
        if e.next_finish() != nf or e.n > nf:
            continue  # stale
        e.t, e.n = t, nf
        for sid in e.pop_finished(ctx0):
            gi, j = divmod(sid, G)
            groups[gi][1][j].done = groups[gi][1][j].length
            left[gi] -= 1
        if advance():
            for e2 in eng:  # abort: every running sample keeps what it has generated
                k = e2.steps_by(t) if e2 is not e else 0
                for sid, s0 in e2.running.items():
                    gi, j = divmod(sid, G)
                    groups[gi][1][j].done += e2.n + k - s0
            return t, ptr, groups[ptr:]
        fill(ei)
    return t, ptr, []


# ----------------------------------------------------------------------------------------------------------------------
# The timeline of producer and trainer


def timeline(gen: list[float], train: list[float], depth: int, sync_s: float) -> dict:
    """Step k trains batch k from version k-1. depth 0 = sync (colocated, one after the other). The producer starts
    batch j once batch j-1 is done and version j-1-depth is synced, outside the pause [before_sync, next_batch];
    the sync waits for the batch in progress (one_step_off: always batch k+1, which starts when step k does)."""
    N = len(gen)
    start, end, sync_end, windows = {}, {0: 0.0}, {0: 0.0}, []
    j = 1

    def can_start(j: int) -> float:
        t = max(end[j - 1], sync_end[max(0, j - 1 - depth)])
        for a, b in windows:
            if a <= t < b:
                t = b
        return t

    busy = 0.0
    for k in range(1, N + 1):
        while j <= k:
            start[j] = can_start(j)
            end[j] = start[j] + gen[j - 1]
            j += 1
        t_train = max(sync_end[k - 1], end[k]) + train[k - 1]
        busy += train[k - 1]
        while depth and j <= min(N, k + depth) and can_start(j) < t_train:
            start[j] = can_start(j)
            end[j] = start[j] + gen[j - 1]
            j += 1
        in_progress = [end[i] for i in start if start[i] < t_train < end[i]]
        sync_end[k] = max([t_train, *in_progress]) + sync_s
        windows.append((t_train, sync_end[k]))
    total = sync_end[N]
    return {"total_s": total, "step_s": total / N, "engine_busy": sum(gen) / total, "trainer_busy": busy / total}


def train_time(inp: Inputs, tokens: int, gpus: int) -> float:
    return inp.train_flops_per_token * inp.params * tokens / (gpus * inp.peak_flops * inp.mfu)


def project(inp: Inputs, steps: int, seed: int) -> list[dict]:
    """One row per schedule: sync and partial colocated; one_step_off and async (with and without partial rollout)
    disaggregated, at the split of nodes that gives each its most samples/s."""
    cache: dict[tuple[int, bool], list[dict]] = {}

    def batches(engines: int, carry: bool) -> list[dict]:
        if (engines, carry) not in cache:
            cache[engines, carry] = rollout_batches(inp, engines, steps, carry, seed)
        return cache[engines, carry]

    rows = []
    engines_all = inp.gpus // inp.tp
    for name, carry in (("sync", False), ("partial", True)):
        b = batches(engines_all, carry)
        tl = timeline([x["gen_s"] for x in b], [train_time(inp, x["train_tokens"], inp.gpus) for x in b], 0, inp.sync_s)
        rows.append(_row(name, f"colocated, {engines_all} engines on all {inp.gpus} GPUs", b, tl))
    async_name = f"async (staleness {inp.max_staleness})"
    for name, depth in (("one_step_off", 1), (async_name, inp.max_staleness)):
        for carry in (False, True):
            best = None
            for r_nodes in range(1, inp.nodes):
                engines = max(1, r_nodes * inp.gpus_per_node // inp.tp)
                b = batches(engines, carry)
                t_gpus = (inp.nodes - r_nodes) * inp.gpus_per_node
                tl = timeline([x["gen_s"] for x in b], [train_time(inp, x["train_tokens"], t_gpus) for x in b], depth,
                              inp.sync_s)  # fmt: skip
                layout = f"{r_nodes} rollout nodes ({engines} engines) + {inp.nodes - r_nodes} train nodes"
                row = _row(name + (" + partial" if carry else ""), layout, b, tl)
                if best is None or row["samples_per_s"] > best["samples_per_s"]:
                    best = row
            rows.append(best)
    base = rows[0]["samples_per_s"]
    for r in rows:
        r["speedup_vs_sync"] = r["samples_per_s"] / base
    return rows


def _row(name: str, layout: str, batches: list[dict], tl: dict) -> dict:
    samples = sum(x["samples"] for x in batches)
    return {"schedule": name, "layout": layout, "step_s": tl["step_s"], "samples_per_s": samples / tl["total_s"],
            "engine_busy": tl["engine_busy"], "trainer_busy": tl["trainer_busy"],
            "gen_s": sum(x["gen_s"] for x in batches) / len(batches),
            "carried_frac": sum(x["carried_frac"] for x in batches) / len(batches)}  # fmt: skip


def table(rows: list[dict]) -> str:
    keys = ["step_s", "samples_per_s", "speedup_vs_sync", "gen_s", "engine_busy", "trainer_busy", "carried_frac"]
    lines = ["| schedule | layout | " + " | ".join(keys) + " |", "|---|---|" + "---:|" * len(keys)]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['layout']} | " + " | ".join(f"{r[k]:.3g}" for k in keys) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lengths", default="dapo", help="dapo (the published shape) or a JSON list of lengths")
    ap.add_argument("--out", default=None, help="write sim_schedule-<date>.md/.json here")
    args = ap.parse_args()
    inp = Inputs()
    if args.lengths != "dapo":
        inp.lengths = [int(x) for x in json.loads(Path(args.lengths).read_text())]
    rows = project(inp, args.steps, args.seed)
    text = "\n".join([
        "# PROJECTION (a model, not a measurement): rollout schedules on 16 nodes x 8 H100",
        "", f"{args.steps} steps, seed {args.seed}, lengths: {args.lengths}. Inputs (sources in bench/sim_schedule.py):",
        "", ", ".join(f"{k}={v}" for k, v in asdict(inp).items() if k != "lengths"), "", table(rows), "",
        f"Check: sync's rollout share of the step {rows[0]['engine_busy']:.2f} (verl's one-step-off docs: ~0.7 for "
        "DAPO-32B). samples_per_s = trained samples per second; engine_busy / trainer_busy = fraction of the run's "
        "time each side works; carried_frac = trained samples begun in an earlier step.",
    ])  # fmt: skip
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        date = datetime.date.today().isoformat()
        (out / f"sim_schedule-{date}.md").write_text(text + "\n")
        (out / f"sim_schedule-{date}.json").write_text(json.dumps({"inputs": asdict(inp), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
