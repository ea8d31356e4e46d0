"""A synthetic task with variable-length reasoning: the sum of 2 to ``max_terms`` digits, with running sums.

    Q: 3+5+2+7=     →     " 3 8 10 17 Answer: 17"      (the warm start's solution: every running sum, then the answer)

It is the toy on which each DAPO technique has something to act on (``bench/ablation.py``):

* length and truncation: the written-out solution grows with the number of terms (≈ 2.5 tokens per term + 11), so with
  ``rollout.sampling.max_new_tokens`` 24 the full chains of 5+ terms run past the limit: a truncated response has no
  "Answer:" and scores −1. The policy must learn to shorten its chains on long problems — what the overlong soft
  punishment shapes, and what overlong filtering changes (truncated samples leave the loss instead of being punished);
* saturation: two- and three-term sums are solved early, so many groups turn all-correct: dynamic sampling drops them;
* entropy: the warm start leaves a peaked policy; with a symmetric clip (0.2) the low-probability tokens that a
  shorter chain needs are the ones whose probability cannot grow fast — clip-higher (0.28) lets them;
* token-level loss: responses range from ~10 to 24+ tokens, so sequence-mean and token-mean weight them differently.

Train and eval problems are disjoint digit sequences; the ground truth is the plain sum.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_dapo.data.dataset import PromptDataset

DATA_SOURCE = "synthetic/chain"


def chain_problem(digits: list[int]) -> str:
    return "+".join(map(str, digits)) + "="


def chain_solution(digits: list[int]) -> str:
    """The running sums then the answer: ``" 3 8 10 17 Answer: 17"``."""
    sums = np.cumsum(digits).tolist()
    return " " + " ".join(map(str, sums)) + f" Answer: {sums[-1]}"


def chain_row(digits: list[int], index: int, split: str) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": chain_problem(digits)}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(sum(digits))},
        "extra_info": {"index": index, "split": split, "terms": len(digits), "solution": chain_solution(digits)},
    }


def chain_splits(train_size: int, eval_size: int, seed: int, max_terms: int = 7) -> tuple[list[dict], list[dict]]:
    """Seeded train and eval rows over disjoint problems, the number of terms uniform in [2, ``max_terms``]."""
    if max_terms < 2:
        raise ValueError(f"data.chain_max_terms = {max_terms}: must be >= 2")
    rng = np.random.default_rng(seed)
    seen: set[tuple[int, ...]] = set()

    def draw(n: int, split: str) -> list[dict]:
        rows: list[dict] = []
        while len(rows) < n:
            k = int(rng.integers(2, max_terms + 1))
            digits = tuple(int(d) for d in rng.integers(1, 10, k))
            if split == "eval" and digits in seen:
                continue
            if split == "eval":
                seen.add(digits)
            elif digits in seen:  # never train on an eval problem
                continue
            rows.append(chain_row(list(digits), len(rows), split))
        return rows

    evals = draw(eval_size, "eval")
    return draw(train_size, "train"), evals


def make_chain_datasets(
    tokenizer: Any,
    train_size: int,
    eval_size: int,
    seed: int,
    max_prompt_len: int,
    max_terms: int = 7,
    apply_chat_template: bool = True,
) -> tuple[PromptDataset, PromptDataset]:
    train, evals = chain_splits(train_size, eval_size, seed, max_terms)
    return (
        PromptDataset.from_rows(train, tokenizer, max_prompt_len, apply_chat_template, name="synthetic chain train"),
        PromptDataset.from_rows(evals, tokenizer, max_prompt_len, apply_chat_template, name="synthetic chain eval"),
    )
