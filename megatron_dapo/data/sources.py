"""A config's datasets: the synthetic tasks (``synthetic.py``, ``chain.py``) or DAPO-schema parquet files
(``dataset.py``) for training, and the eval sets. Separate from ``dataset.py``, which the task modules build on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_dapo.data.chain import DATA_SOURCE as CHAIN
from megatron_dapo.data.chain import make_chain_datasets
from megatron_dapo.data.chain_mix import DATA_SOURCE as CHAIN_MIX
from megatron_dapo.data.chain_mix import make_chain_mix_datasets
from megatron_dapo.data.dataset import PromptDataset
from megatron_dapo.data.synthetic import DATA_SOURCE, make_add2_datasets
from megatron_dapo.data.tool_mul import DATA_SOURCE as TOOL_MUL
from megatron_dapo.data.tool_mul import make_tool_mul_datasets
from megatron_dapo.data.word_math import DATA_SOURCE as WORD_MATH
from megatron_dapo.data.word_math import make_word_math_datasets


def build_prompt_datasets(cfg: Any, tokenizer: Any) -> tuple[PromptDataset, dict[str, PromptDataset]]:
    """The train dataset and the eval datasets (by name) of a ``DapoConfig``.

    ``data.synthetic = "add2"``: the synthetic task (seeded by ``train.seed``), whose held-out split is the eval set
    ``"synthetic/add2"``; otherwise ``data.train_files``. Each of ``eval.files`` becomes one eval set named after the
    file stem, de-duplicated to one item per problem (``eval.n`` samples are drawn per problem: avg@n).
    """
    d = cfg.data
    evals: dict[str, PromptDataset] = {}
    if d.synthetic == "add2":
        train, synthetic_eval = make_add2_datasets(
            tokenizer,
            d.synthetic_train_size,
            d.synthetic_eval_size,
            cfg.train.seed,
            d.max_prompt_len,
            apply_chat_template=d.apply_chat_template,
        )
        evals[DATA_SOURCE] = synthetic_eval
    elif d.synthetic == "chain":
        train, evals[CHAIN] = make_chain_datasets(
            tokenizer,
            d.synthetic_train_size,
            d.synthetic_eval_size,
            cfg.train.seed,
            d.max_prompt_len,
            d.chain_max_terms,
            d.apply_chat_template,
        )
    elif d.synthetic == "chain_mix":  # the held-out set: eval, or dev (named so) to select a warm start on
        name = CHAIN_MIX if d.synthetic_eval_split == "eval" else f"{CHAIN_MIX}-dev"
        train, evals[name] = make_chain_mix_datasets(
            tokenizer,
            d.synthetic_train_size,
            d.synthetic_eval_size,
            cfg.train.seed,
            d.max_prompt_len,
            d.chain_max_terms,
            d.synthetic_eval_split,
            d.apply_chat_template,
        )
    elif d.synthetic == "word_math":  # word problems for a real tokenizer (SmolLM2 recipe)
        train, evals[WORD_MATH] = make_word_math_datasets(
            tokenizer,
            d.synthetic_train_size,
            d.synthetic_eval_size,
            cfg.train.seed,
            d.max_prompt_len,
            d.word_math_max_ops,
            d.apply_chat_template,
        )
    elif d.synthetic == "tool_mul":  # a task the model needs the calculator for (the tool agent's example)
        train, evals[TOOL_MUL] = make_tool_mul_datasets(
            tokenizer,
            d.synthetic_train_size,
            d.synthetic_eval_size,
            cfg.train.seed,
            d.max_prompt_len,
            d.apply_chat_template,
        )
    else:
        train = PromptDataset.from_files(
            d.train_files, tokenizer, d.max_prompt_len, d.apply_chat_template, d.prompt_overflow
        )
    evals.update(build_eval_datasets(cfg, tokenizer))
    return train, evals


def build_eval_datasets(cfg: Any, tokenizer: Any) -> dict[str, PromptDataset]:
    """One eval set per ``eval.files`` entry, named after the file stem, one item per problem."""
    d = cfg.data
    return {
        Path(path).stem: PromptDataset.from_files(
            [path], tokenizer, d.max_prompt_len, d.apply_chat_template, d.prompt_overflow
        ).unique()
        for path in cfg.eval.files
    }
