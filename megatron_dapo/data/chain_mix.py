"""The ablation toy in the paper's regime: chains of 2 to ``max_terms`` digits, answered directly or worked out.

    Q: 3 5 2 7=     →     " Answer: 4"             direct: short (11 tokens, eos included), often wrong on long chains
                    →     " 2 0 7 Answer: 7"       written out: each step, longer (13-21 tokens), reliable

The value of a chain is its absolute differences taken in order: x = d1, then x = |x − d| for each next digit
(|3 − 5| = 2, |2 − 2| = 0, |0 − 7| = 7). Unlike a sum, it depends on the order of the digits, so a small model cannot
read it off the digits at once (a sum it can: on chain sums a warm start answered directly more accurately than it
wrote out the running sums, measured 2026-12-01), while each written step is one lookup at a fixed distance from the
digit it takes. Built for ``bench/ablation.py``, so that each DAPO technique has the work the paper gives
it:

* every problem is solvable with margin: the longest written-out solution (6 terms: 21 tokens with its eos) fits in
  the no-penalty region of ``chain_mix_cpu`` (L_max − L_cache = 40 − 8 = 32 tokens);
* a reason for responses to grow: the warm start imitates a mixture, half the rows answered directly and half
  written out (``DIRECT_SHARE``), so its policy answers directly about half the time; on long chains the written-out
  answer is the reliable one, so RL lengthens the responses, and those that do not stop run into the cache window and
  past L_max (the samples the soft punishment and overlong filtering act on);
* saturation: two-term chains (81 problems) are solved early, so their groups turn all-correct.

Splits are fixed by the problem itself, not by ``train.seed``: a problem's CRC-32 puts it in ``eval`` (10%), ``dev``
(10%) or ``train`` (80%), so no seed ever trains on an eval or dev problem, and every seed and rung evaluates on the
same problems (stratified by the number of terms, drawn with a fixed seed). ``dev`` selects the warm start
(``data.synthetic_eval_split = dev``); ``eval`` is never trained or selected on. The ground truth is the chain's
value, scored by the DAPO rule.
"""

from __future__ import annotations

import itertools
import zlib
from typing import Any

import numpy as np

from megatron_dapo.data.dataset import PromptDataset
from megatron_dapo.data.synthetic import stratified_take

DATA_SOURCE = "synthetic/chain_mix"
DIRECT_SHARE = 0.5  # share of the warm start's rows answered directly
SPLITS = ("eval", "dev", "train")
HELD_OUT_SEED = 20251201  # draws the eval and dev problems: the same for every train.seed
_BUCKETS = {0: "eval", 1: "dev"}  # CRC-32 % 10 of the problem; the rest is train


def problem(digits: list[int] | tuple[int, ...]) -> str:
    """``3 5 2 7=``: two characters per digit, as per written-out step (``written_solution``)."""
    return " ".join(map(str, digits)) + "="


def steps(digits: list[int]) -> list[int]:
    """The chain's values after each digit: x = d1, then x = |x − d|."""
    out = [digits[0]]
    for d in digits[1:]:
        out.append(abs(out[-1] - d))
    return out


def value(digits: list[int]) -> int:
    return steps(digits)[-1]


def written_solution(digits: list[int]) -> str:
    """Every step from the second digit on, then the answer: ``" 2 0 7 Answer: 7"``."""
    return " " + " ".join(map(str, steps(digits)[1:])) + f" Answer: {value(digits)}"


def split_of(digits: list[int] | tuple[int, ...]) -> str:
    """``eval`` | ``dev`` | ``train``: fixed by the problem text."""
    return _BUCKETS.get(zlib.crc32(problem(digits).encode()) % 10, "train")


def direct_solution(digits: list[int]) -> str:
    return f" Answer: {value(digits)}"


def chain_mix_row(digits: list[int], index: int, split: str, direct: bool) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem(digits)}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(value(digits))},
        "extra_info": {
            "index": index,
            "split": split,
            "terms": len(digits),
            "style": "direct" if direct else "written",
            "solution": direct_solution(digits) if direct else written_solution(digits),  # the warm start's target
        },
    }


def _draw(rng: np.random.Generator, split: str, max_terms: int) -> list[int]:
    while True:
        digits = [int(d) for d in rng.integers(1, 10, int(rng.integers(2, max_terms + 1)))]
        if split_of(digits) == split:
            return digits


def held_out_rows(split: str, size: int, max_terms: int) -> list[dict]:
    """``size`` distinct problems of ``split`` (eval | dev), as even over the number of terms as the split allows
    (two-term chains have only ~8 per split), the same for every seed. Their extra_info.solution is the written one."""
    if split not in ("eval", "dev"):
        raise ValueError(f"held-out split {split!r}: must be eval or dev")
    terms = list(range(2, max_terms + 1))
    pools = {k: _all_of(split, k, size) for k in terms}
    chosen = stratified_take(
        pools,
        size,
        f"data.synthetic_eval_size = {size}: the {split} split has only {{have}} problems of 2-{max_terms} terms",
    )
    return [chain_mix_row(d, i, split, direct=False) for i, d in enumerate(chosen)]


def _all_of(split: str, k: int, size: int) -> list[list[int]]:
    """Up to ``size`` distinct problems of ``k`` terms in ``split``, in a fixed random order."""
    rng = np.random.default_rng([HELD_OUT_SEED, k, SPLITS.index(split)])
    if k <= 5:  # enumerate (9**5 = 59,049 problems)
        pool = [list(d) for d in itertools.product(range(1, 10), repeat=k) if split_of(d) == split]
        return [pool[i] for i in rng.permutation(len(pool))[:size]]
    seen: dict[tuple[int, ...], None] = {}
    while len(seen) < size:
        d = tuple(int(x) for x in rng.integers(1, 10, k))
        if split_of(d) == split:
            seen[d] = None
    return [list(d) for d in seen]


def train_rows(size: int, seed: int, max_terms: int, direct_share: float = DIRECT_SHARE) -> list[dict]:
    """``size`` train-split rows (the number of terms uniform in [2, max_terms]), each answered directly with
    probability ``direct_share`` in its warm-start solution, else written out; seeded by ``seed``."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(size):
        digits = _draw(rng, "train", max_terms)
        rows.append(chain_mix_row(digits, i, "train", direct=bool(rng.random() < direct_share)))
    return rows


def make_chain_mix_datasets(
    tokenizer: Any,
    train_size: int,
    eval_size: int,
    seed: int,
    max_prompt_len: int,
    max_terms: int = 6,
    eval_split: str = "eval",
    apply_chat_template: bool = True,
) -> tuple[PromptDataset, PromptDataset]:
    """(train, held-out) datasets; the held-out one is the ``eval_split`` partition (``dev`` for a warm start)."""
    if max_terms < 2:
        raise ValueError(f"data.chain_max_terms = {max_terms}: must be >= 2")
    train = train_rows(train_size, seed, max_terms)
    held = held_out_rows(eval_split, eval_size, max_terms)
    return (
        PromptDataset.from_rows(
            train, tokenizer, max_prompt_len, apply_chat_template, name="synthetic chain_mix train"
        ),
        PromptDataset.from_rows(
            held, tokenizer, max_prompt_len, apply_chat_template, name=f"synthetic chain_mix {eval_split}"
        ),
    )
