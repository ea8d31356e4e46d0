"""Prompt data: DAPO-schema parquet via ``datasets``, chat templating, tokenizers, the synthetic task, packing."""

from megatron_dapo.data.dataset import (
    DataError,
    PromptDataset,
    PromptItem,
    PromptIterator,
    check_row,
    load_parquet_rows,
    prompt_key,
    validate_rows,
    write_parquet_atomic,
)
from megatron_dapo.data.sources import build_eval_datasets, build_prompt_datasets
from megatron_dapo.data.synthetic import (
    add2_splits,
    make_add2_datasets,
    supervised_target_ids,
    supervised_target_text,
    write_add2_parquet,
)
from megatron_dapo.data.tokenizer import CharTokenizer, load_tokenizer

__all__ = [
    "CharTokenizer",
    "DataError",
    "PromptDataset",
    "PromptItem",
    "PromptIterator",
    "add2_splits",
    "build_eval_datasets",
    "build_prompt_datasets",
    "check_row",
    "load_parquet_rows",
    "load_tokenizer",
    "make_add2_datasets",
    "prompt_key",
    "supervised_target_ids",
    "supervised_target_text",
    "validate_rows",
    "write_add2_parquet",
    "write_parquet_atomic",
]
