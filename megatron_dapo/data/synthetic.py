"""A synthetic verifiable task: zero-padded two-digit addition, in the DAPO schema.

    train, evals = add2_splits(train_size=20000, eval_size=200, seed=1234)     # DAPO-schema rows, disjoint problems
    write_add2_parquet("data/", 20000, 200, seed=1234)                         # add2-train.parquet, add2-eval.parquet
    supervised_target_text("52")                                               # " Answer: 52" (+ eos in the ids)

A problem is ``a+b`` with 0 <= a, b <= 99 written ``07+45=`` (10,000 problems); the ground truth is the plain sum
(``"52"``) and a correct response is `` Answer: 52``, which the DAPO rule scores +1. The eval problems are held out:
no train row has an eval problem. Two wordings: ``compact`` (``07+45=``, for the char tokenizer: short sequences for a
tiny model) and ``dapo`` (the DAPO-Math-17k instruction around the problem, for real tokenizers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from megatron_dapo.data.dataset import PromptDataset, write_parquet_atomic
from megatron_dapo.data.tokenizer import CharTokenizer

DATA_SOURCE = "synthetic/add2"
COMPACT, DAPO = "compact", "dapo"
WORDINGS = (COMPACT, DAPO)
NUM_PROBLEMS = 100 * 100
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def add2_problem(a: int, b: int) -> str:
    return f"{a:02d}+{b:02d}="


def add2_row(a: int, b: int, index: int, split: str, wording: str = COMPACT) -> dict:
    """One DAPO-schema row for ``a+b``."""
    if wording not in WORDINGS:
        raise ValueError(f"synthetic wording {wording!r}: must be one of {', '.join(WORDINGS)}")
    problem = add2_problem(a, b)
    content = problem if wording == COMPACT else DAPO_TEMPLATE.format(problem=f"What is {a:02d}+{b:02d}?")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": content}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"index": index, "split": split, "problem": problem},
    }


def add2_splits(train_size: int, eval_size: int, seed: int, wording: str = COMPACT) -> tuple[list[dict], list[dict]]:
    """Seeded train and eval rows over disjoint problems.

    The eval rows are ``eval_size`` distinct problems; the train rows cycle through shuffled passes over the other
    problems (so ``train_size`` may exceed their number, each then repeated evenly).
    """
    if not 0 < eval_size < NUM_PROBLEMS:
        raise ValueError(f"synthetic eval_size = {eval_size}: must be in [1, {NUM_PROBLEMS - 1}]")
    if train_size < 1:
        raise ValueError(f"synthetic train_size = {train_size}: must be >= 1")
    rng = np.random.default_rng(seed)
    problems = rng.permutation(NUM_PROBLEMS)
    eval_ids, pool = problems[:eval_size], problems[eval_size:]
    passes = -(-train_size // len(pool))
    train_ids = np.concatenate([rng.permutation(pool) for _ in range(passes)])[:train_size]

    def rows(ids: np.ndarray, split: str) -> list[dict]:
        return [add2_row(int(p) // 100, int(p) % 100, i, split, wording) for i, p in enumerate(ids)]

    return rows(train_ids, "train"), rows(eval_ids, "eval")


def write_add2_parquet(
    out_dir: str | Path, train_size: int, eval_size: int, seed: int, wording: str = COMPACT
) -> tuple[Path, Path]:
    """Write ``add2-train.parquet`` and ``add2-eval.parquet`` into ``out_dir``; returns their paths."""
    train, evals = add2_splits(train_size, eval_size, seed, wording)
    out_dir = Path(out_dir)
    return write_parquet_atomic(train, out_dir / "add2-train.parquet"), write_parquet_atomic(
        evals, out_dir / "add2-eval.parquet"
    )


def default_wording(tokenizer: Any) -> str:
    """``compact`` for the char tokenizer (it cannot spell the DAPO instruction), ``dapo`` for real tokenizers."""
    return COMPACT if isinstance(tokenizer, CharTokenizer) else DAPO


def make_add2_datasets(
    tokenizer: Any,
    train_size: int,
    eval_size: int,
    seed: int,
    max_prompt_len: int,
    wording: str | None = None,
    apply_chat_template: bool = True,
) -> tuple[PromptDataset, PromptDataset]:
    """In-memory train and eval ``PromptDataset``s of the task (the wording defaults to ``default_wording``)."""
    train, evals = add2_splits(train_size, eval_size, seed, wording or default_wording(tokenizer))
    return (
        PromptDataset.from_rows(train, tokenizer, max_prompt_len, apply_chat_template, name="synthetic add2 train"),
        PromptDataset.from_rows(evals, tokenizer, max_prompt_len, apply_chat_template, name="synthetic add2 eval"),
    )


def supervised_target_text(ground_truth: str) -> str:
    """The response a perfect policy writes: ``" Answer: 52"``."""
    return f" Answer: {ground_truth}"


def supervised_target_ids(tokenizer: Any, ground_truth: str, extra: dict | None = None) -> list[int]:
    """Token ids of the row's written-out solution (``extra_info.solution``, e.g. the chain task's running sums) or
    else :func:`supervised_target_text`, followed by the tokenizer's eos (for the warm start)."""
    return supervised_target(tokenizer, ground_truth, extra)[0]


def supervised_target(tokenizer: Any, ground_truth: str, extra: dict | None = None) -> tuple[list[int], list[int]]:
    """The warm start's response ids and loss mask: ``extra_info.solution_parts`` (``[text, trained]`` pieces: a
    tool's output is context, not trained) or the solution text (all trained), then the eos."""
    info = (extra or {}).get("extra_info") or {}
    parts = info.get("solution_parts") or [[info.get("solution") or supervised_target_text(ground_truth), 1]]
    ids, mask = [], []
    for text, trained in parts:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [int(trained)] * len(piece)
    return [*ids, tokenizer.eos_token_id], [*mask, 1]


def stratified_take(pools: dict, size: int, short: str) -> list:
    """``size`` items taken round-robin over ``pools`` (one list per stratum: a number of terms, of steps) while a pool
    has items left, as even as the pools allow, in stratum order; ``short`` (formatted with ``have``, the items the
    pools hold) is the ValueError when they hold fewer than ``size``."""
    quota, left = dict.fromkeys(pools, 0), size
    while left > 0:
        open_ = [k for k in pools if quota[k] < len(pools[k])]
        if not open_:
            raise ValueError(short.format(have=sum(quota.values())))
        for k in open_[:left]:
            quota[k] += 1
            left -= 1
    return [item for k in pools for item in pools[k][: quota[k]]]
