"""bench/sim_schedule.py (the schedule projection) on a tiny layout: properties the model must keep, not its numbers."""

from __future__ import annotations

import random
import sys

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "bench"))
import sim_schedule as sim  # noqa: E402

TINY = dict(nodes=4, gpus_per_node=2, tp=1, slots=8, batch_prompts=8, group_size=4, gen_batch_prompts=24,
            mean_len=300, max_len=4096, prompt_len=50, params=1e9, weight_bytes=2e9, sync_s=0.5)  # fmt: skip


def rate(rows, name):
    return next(r["samples_per_s"] for r in rows if r["schedule"] == name)


def test_partial_is_never_slower_than_sync_on_long_tailed_lengths():
    inp = sim.Inputs(**TINY)  # lognormal with 3% at the cap, the same decode rate for every sample
    for seed in range(5):
        rows = sim.project(inp, 4, seed)
        assert rate(rows, "partial") >= rate(rows, "sync"), seed
        assert rate(rows, "one_step_off + partial") >= rate(rows, "one_step_off"), seed


def test_with_nothing_to_carry_partial_equals_sync():
    inp = sim.Inputs(**{**TINY, "gen_batch_prompts": 8, "informative_p": 1.0})  # no surplus at the cut
    rows = sim.project(inp, 3, 0)
    assert rate(rows, "partial") == rate(rows, "sync")
    assert all(r["carried_frac"] == 0 for r in rows)


def test_overlapping_generation_with_training_never_lengthens_the_run():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 8)
        gen = [rng.expovariate(1.0) for _ in range(n)]
        train = [rng.expovariate(1.0) for _ in range(n)]
        serial = sim.timeline(gen, train, 0, 0.1)["total_s"]
        assert abs(serial - (sum(gen) + sum(train) + 0.1 * n)) < 1e-9
        assert sim.timeline(gen, train, 1, 0.1)["total_s"] <= serial + 1e-9
        assert sim.timeline(gen, train, 1, 0.1)["total_s"] >= max(sum(gen), sum(train))  # a bound, not a wish


def test_the_output_says_it_is_a_projection_and_cites_its_inputs():
    assert sim.__doc__.startswith("A PROJECTION") and "arXiv:2503.14476" in sim.__doc__
    assert "ASSUMPTION" in sim.__doc__
    table = sim.table(sim.project(sim.Inputs(**TINY), 2, 0))
    assert table.count("\n") == 1 + 6 and "speedup_vs_sync" in table
