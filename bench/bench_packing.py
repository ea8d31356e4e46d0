"""Packing benchmark on a DAPO-like length mix: padding waste vs pad-to-longest, DP load balance, micro-batch counts.

    .venv/bin/python bench/bench_packing.py [--seed 0] [--dp 16] [--pad-multiple 128]

Lengths: prompts uniform in 100–2048 tokens, responses lognormal (mean ≈ 4.5k) clipped at 20480 (the DAPO
max response), B = 512 prompts × G = 16 = 8192 sequences per step, 16 mini-batches of 512 sequences. Goal: packed
padding waste ≤ 5% (prints PASS/FAIL; always exits 0 — benchmarks never gate).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from megatron_dapo.data.packing import balance_across_dp, pad_to_longest_waste, padding_waste, split_mini_batches

GOAL_WASTE = 0.05


def dapo_lengths(n: int, seed: int, max_prompt: int = 2048, max_response: int = 20480) -> list[int]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(100, max_prompt + 1, n)
    responses = np.clip(rng.lognormal(np.log(3300), 0.8, n), 50, max_response).astype(int)
    return (prompts + responses).tolist()


def arrival_order_baseline(lengths: list[int], dp: int, micro_batches: int) -> tuple[float, float]:
    """What a padded trainer does: contiguous equal-count DP shards, fixed-size micro-batches padded to the longest
    (same number of micro-batches per rank as ours). Returns (pad-to-longest waste, DP max/min load)."""
    shards = np.array_split(np.arange(len(lengths)), dp)
    mbs = [chunk.tolist() for shard in shards for chunk in np.array_split(shard, micro_batches) if len(chunk)]
    loads = [sum(lengths[i] for i in shard) for shard in shards]
    return pad_to_longest_waste(lengths, mbs), max(loads) / min(loads)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dp", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--updates", type=int, default=16)
    ap.add_argument("--pad-multiple", type=int, default=128)
    args = ap.parse_args(argv)
    n = args.prompts * args.group
    lengths = dapo_lengths(n, args.seed)
    resp = np.array(lengths)
    print(
        f"{n} sequences: mean {resp.mean():.0f} tokens (prompt+response), p50 {np.median(resp):.0f}, "
        f"p99 {np.percentile(resp, 99):.0f}, max {resp.max()}; DP = {args.dp}, pad multiple {args.pad_multiple}"
    )
    header = f"{'scope':<26}{'budget':>8}{'µb/rank':>9}{'split':>7}{'empty':>7}{'max/min':>9}{'waste':>8}"
    header += f"{'longest*':>10}{'arrival pad':>13}{'arrival max/min':>17}{'ms':>8}"
    print(header)
    worst_waste = 0.0
    for budget in (22528, 2 * 22528):
        rows = [("whole step", list(range(n)))]
        rows += [(f"mini-batch {k}", list(r)) for k, r in enumerate(split_mini_batches(n, args.updates))]
        agg = {"imb": [], "waste_pad": 0, "real": 0, "mbs": []}
        for scope, idx in rows:
            sub = [lengths[i] for i in idx]
            t = time.perf_counter()
            ranks, st = balance_across_dp(sub, args.dp, budget, pad_multiple=args.pad_multiple)
            ms = (time.perf_counter() - t) * 1e3
            flat = [mb for r in ranks for mb in r]
            assert abs(padding_waste(sub, flat, args.pad_multiple) - st.padding_waste) < 1e-12
            base_waste, base_imb = arrival_order_baseline(sub, args.dp, st.num_micro_batches)
            if scope == "whole step" or scope == "mini-batch 0":
                print(
                    f"{scope:<26}{budget:>8}{st.num_micro_batches:>9}{st.split_micro_batches:>7}"
                    f"{st.empty_micro_batches:>7}{st.imbalance:>9.4f}{st.padding_waste:>8.2%}"
                    f"{st.pad_to_longest_waste:>10.2%}{base_waste:>13.2%}{base_imb:>17.3f}{ms:>8.1f}"
                )
            if scope != "whole step":
                agg["imb"].append(st.imbalance)
                agg["waste_pad"] += st.padded_tokens
                agg["real"] += st.real_tokens
                agg["mbs"].append(st.num_micro_batches)
            worst_waste = max(worst_waste, st.padding_waste)
        mb_range = f"{min(agg['mbs'])}–{max(agg['mbs'])}"
        print(
            f"{'all ' + str(args.updates) + ' mini-batches':<26}{budget:>8}{mb_range:>9}"
            f"{'':>14}{max(agg['imb']):>9.4f}{agg['waste_pad'] / agg['real'] - 1:>8.2%}   (worst imbalance, total waste)"
        )
    print("longest* = our micro-batches padded to k × longest; arrival = contiguous DP shards, same micro-batch count")
    verdict = "PASS" if worst_waste <= GOAL_WASTE else "FAIL"
    print(f"{verdict}: worst packed padding waste {worst_waste:.2%} (goal ≤ {GOAL_WASTE:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
