"""A synthetic word-problem task for a small real model (SmolLM2-135M-Instruct, recipe ``smollm2_math_cpu``).

    Mia has 7 pencils. She finds 5 more. Then she gives away 3. How many pencils does Mia have now?     ->  "9"

A problem starts from a count in [2, 20] and applies 1 to ``max_ops`` steps, each adding 2-12 or taking away part of
what is there (never below 1); the ground truth is the final count, scored by the DAPO "Answer:" rule. The prompt is
the DAPO-Math-17k instruction (``synthetic.DAPO_TEMPLATE``, ending "Answer: $Answer"), so it needs a real tokenizer.

Splits are fixed by the arithmetic, not by the seed or the wording: the CRC-32 of a problem's signature (``"7+5-3"``)
puts 10% of all signatures in ``eval``; the train rows never use one, whatever the names and items. The eval problems
are drawn with a fixed seed, evenly over the number of steps (every ``train.seed`` evaluates the same problems); the
train rows are drawn with ``train.seed``. ``extra_info.solution`` is a worked solution ending in "Answer: N" (the
target of an optional supervised format warm start).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from megatron_dapo.data.dataset import PromptDataset
from megatron_dapo.data.synthetic import DAPO_TEMPLATE, stratified_take

DATA_SOURCE = "synthetic/word_math"
HELD_OUT_SEED = 20261201  # draws the eval problems: the same for every train.seed
START, ADD, TAKE = (2, 20), (2, 12), (1, 9)  # inclusive ranges: the start, an added amount, an amount taken away
NAMES = (
    ("Mia", "She"),
    ("Tom", "He"),
    ("Ana", "She"),
    ("Leo", "He"),
    ("Zoe", "She"),
    ("Sam", "He"),
    ("Ivy", "She"),
    ("Max", "He"),
)
ITEMS = ("apples", "pencils", "stickers", "marbles", "cards", "coins", "books", "shells")
ADD_VERBS = ("finds", "buys", "gets", "is given")
TAKE_VERBS = ("gives away", "loses", "sells", "uses")


def signature(start: int, steps: list[int]) -> str:
    """The arithmetic of a problem: ``"7+5-3"`` (a step is a signed amount)."""
    return str(start) + "".join(f"{s:+d}" for s in steps)


def split_of(start: int, steps: list[int]) -> str:
    return "eval" if zlib.crc32(signature(start, steps).encode()) % 10 == 0 else "train"


def _draw_arith(rng: np.random.Generator, n_steps: int) -> tuple[int, list[int]]:
    value = int(rng.integers(START[0], START[1] + 1))
    start, steps = value, []
    for _ in range(n_steps):
        if value > 1 and rng.random() < 0.5:
            step = -int(rng.integers(TAKE[0], min(TAKE[1], value - 1) + 1))
        else:
            step = int(rng.integers(ADD[0], ADD[1] + 1))
        steps.append(step)
        value += step
    return start, steps


def word_problem(start: int, steps: list[int], name: str, pronoun: str, item: str, rng: np.random.Generator) -> str:
    parts = [f"{name} has {start} {item}."]
    for i, step in enumerate(steps):
        verb = (
            ADD_VERBS[int(rng.integers(len(ADD_VERBS)))] if step > 0 else TAKE_VERBS[int(rng.integers(len(TAKE_VERBS)))]
        )
        amount = f"{step} more" if step > 0 else f"{-step}"
        parts.append(f"{'Then ' + pronoun.lower() if i else pronoun} {verb} {amount}.")
    parts.append(f"How many {item} does {name} have now?")
    return " ".join(parts)


def worked_solution(start: int, steps: list[int]) -> str:
    """One line per step, then the answer: ``"7 + 5 = 12\\n12 - 3 = 9\\nAnswer: 9"``."""
    lines, value = [], start
    for step in steps:
        new = value + step
        lines.append(f"{value} {'+' if step > 0 else '-'} {abs(step)} = {new}")
        value = new
    return "\n".join([*lines, f"Answer: {value}"])


def word_math_row(start: int, steps: list[int], index: int, split: str, rng: np.random.Generator) -> dict:
    name, pronoun = NAMES[int(rng.integers(len(NAMES)))]
    problem = word_problem(start, steps, name, pronoun, ITEMS[int(rng.integers(len(ITEMS)))], rng)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": DAPO_TEMPLATE.format(problem=problem)}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(start + sum(steps))},
        "extra_info": {
            "index": index,
            "split": split,
            "steps": len(steps),
            "signature": signature(start, steps),
            "problem": problem,
            "solution": worked_solution(start, steps),
        },
    }


def _check_max_ops(max_ops: int) -> None:
    if max_ops < 1:
        raise ValueError(f"data.word_math_max_ops = {max_ops}: must be >= 1")


def _eval_pool(k: int, size: int) -> list[tuple[int, list[int]]]:
    """Up to ``size`` distinct eval-split problems of ``k`` steps, in a fixed random order."""
    rng = np.random.default_rng([HELD_OUT_SEED, k])
    pool: dict[str, tuple[int, list[int]]] = {}
    for _ in range(max(20 * size, 4000)):  # one step has only ~35 eval problems: stop drawing at the tries' end
        start, steps = _draw_arith(rng, k)
        if split_of(start, steps) == "eval":
            pool.setdefault(signature(start, steps), (start, steps))
            if len(pool) == size:
                break
    return list(pool.values())


def eval_rows(size: int, max_ops: int) -> list[dict]:
    """``size`` distinct eval-split problems, as even over 1..``max_ops`` steps as the split allows (one-step
    problems are few); no seed in it."""
    _check_max_ops(max_ops)
    pools = {k: _eval_pool(k, size) for k in range(1, max_ops + 1)}
    chosen = stratified_take(
        pools,
        size,
        f"data.synthetic_eval_size = {size}: the eval split has only {{have}} "
        f"problems of <= {max_ops} steps; raise data.word_math_max_ops",
    )
    rng = np.random.default_rng(HELD_OUT_SEED)  # the wording
    return [word_math_row(start, steps, i, "eval", rng) for i, (start, steps) in enumerate(chosen)]


def train_rows(size: int, seed: int, max_ops: int) -> list[dict]:
    """``size`` train-split rows, the number of steps uniform in 1..``max_ops``, seeded by ``seed``."""
    _check_max_ops(max_ops)
    if size < 1:
        raise ValueError(f"data.synthetic_train_size = {size}: must be >= 1")
    rng = np.random.default_rng(seed)
    rows = []
    while len(rows) < size:
        start, steps = _draw_arith(rng, int(rng.integers(1, max_ops + 1)))
        if split_of(start, steps) == "train":
            rows.append(word_math_row(start, steps, len(rows), "train", rng))
    return rows


def make_word_math_datasets(
    tokenizer: Any,
    train_size: int,
    eval_size: int,
    seed: int,
    max_prompt_len: int,
    max_ops: int = 2,
    apply_chat_template: bool = True,
) -> tuple[PromptDataset, PromptDataset]:
    train, held = train_rows(train_size, seed, max_ops), eval_rows(eval_size, max_ops)
    return (
        PromptDataset.from_rows(
            train, tokenizer, max_prompt_len, apply_chat_template, name="synthetic word_math train"
        ),
        PromptDataset.from_rows(held, tokenizer, max_prompt_len, apply_chat_template, name="synthetic word_math eval"),
    )
