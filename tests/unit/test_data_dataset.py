"""Prompt parquet loading and validation, chat templating + left truncation, dedup groups, the resumable iterator."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo.data.dataset import DataError, PromptDataset, PromptIterator, load_parquet_rows, prompt_key
from megatron_dapo.data.tokenizer import CharTokenizer, load_tokenizer
from tests.helpers import make_char_hf_tokenizer

REPO = Path(__file__).resolve().parents[2]
AIME = REPO / "data" / "aime-2024.parquet"


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A real HF fast tokenizer (one token per character, ChatML template), loaded back through ``load_tokenizer``."""
    loaded = load_tokenizer(make_char_hf_tokenizer(tmp_path_factory.mktemp("hf_tokenizer")))
    assert not isinstance(loaded, CharTokenizer)
    return loaded


def _chatml_length(messages: list[dict]) -> int:
    """Independent token count for the ChatML template above with one token per character."""
    n = sum(1 + len(m["role"]) + 1 + len(m["content"]) + 1 + 1 for m in messages)  # start role \n content end \n
    return n + 1 + len("assistant\n")


def _write(rows: list[dict], path: Path) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _good_row(i: int, truth: str | None = None) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": truth if truth is not None else str(2 * i), "style": "rule"},
        "extra_info": {"index": i},
    }


# -- the real AIME-2024 file ------------------------------------------------------------------------------------------


def test_aime_loads_validates_and_groups(hf_tokenizer) -> None:
    reference = pq.read_table(AIME).to_pylist()  # independent read with pyarrow
    rows = load_parquet_rows(AIME)
    assert len(rows) == len(reference) == 960
    ds = PromptDataset.from_files([AIME], hf_tokenizer, max_prompt_len=4096)
    assert len(ds) == 960 and ds.num_truncated == 0
    counts = Counter(r["prompt"][0]["content"] for r in reference)
    assert len(counts) == 30 and set(counts.values()) == {32}
    groups = ds.groups()
    assert len(groups) == 30 and all(len(g) == 32 for g in groups.values())
    unique = ds.unique()
    assert len(unique) == 30 and [it.index for it in unique] == list(range(30))
    first_rows = {}
    for r in reference:
        first_rows.setdefault(r["prompt"][0]["content"], r)
    assert [it.messages[0]["content"] for it in unique] == list(first_rows)
    assert [it.ground_truth for it in unique] == [r["reward_model"]["ground_truth"] for r in first_rows.values()]
    item = ds[17]
    assert item.data_source == "math_dapo" and item.reward_style == reference[17]["reward_model"]["style"]
    assert item.source.endswith("aime-2024.parquet row 17")
    assert item.extra["extra_info"]["index"] == reference[17]["extra_info"]["index"]
    assert len(item.prompt_ids) == _chatml_length(reference[17]["prompt"])
    assert hf_tokenizer.decode(item.prompt_ids).endswith("<|im_start|>assistant\n")


# -- validation errors name file, row and column ---------------------------------------------------------------------


def test_missing_ground_truth_names_row_and_column(tmp_path: Path) -> None:
    rows = [_good_row(i) for i in range(20)]
    rows[17]["reward_model"] = {"ground_truth": None, "style": "rule"}
    path = _write(rows, tmp_path / "bad-truth.parquet")
    with pytest.raises(DataError, match=r"bad-truth\.parquet row 17: reward_model\.ground_truth is missing"):
        load_parquet_rows(path)


@pytest.mark.parametrize(
    "mutate, pattern",
    [
        (
            lambda r: r.update(reward_model={"ground_truth": "  ", "style": "rule"}),
            r"row 3: reward_model\.ground_truth is empty",
        ),
        (lambda r: r.update(prompt=[{"role": "robot", "content": "hi"}]), r"row 3: prompt\[0\]\.role is 'robot'"),
        (lambda r: r.update(prompt=[]), r"row 3: prompt is not a chat list .*empty list"),
        (lambda r: r.update(data_source=""), r"row 3: data_source"),
    ],
)
def test_bad_rows_are_named(tmp_path: Path, mutate, pattern: str) -> None:
    rows = [_good_row(i) for i in range(6)]
    mutate(rows[3])
    with pytest.raises(DataError, match=pattern):
        load_parquet_rows(_write(rows, tmp_path / "bad.parquet"))


def test_prompt_as_plain_string_is_rejected(tmp_path: Path) -> None:
    rows = [{**_good_row(i), "prompt": f"What is {i} + {i}?"} for i in range(5)]
    with pytest.raises(DataError, match=r"bad-prompt\.parquet row 0: prompt is not a chat list .*got str"):
        load_parquet_rows(_write(rows, tmp_path / "bad-prompt.parquet"))


def test_missing_column_and_missing_file(tmp_path: Path) -> None:
    rows = [{k: v for k, v in _good_row(i).items() if k != "reward_model"} for i in range(3)]
    with pytest.raises(DataError, match=r"no-rm\.parquet: column 'reward_model' is missing"):
        load_parquet_rows(_write(rows, tmp_path / "no-rm.parquet"))
    with pytest.raises(DataError, match="nope.parquet: no such file"):
        load_parquet_rows(tmp_path / "nope.parquet")


def test_many_bad_rows_are_summarized(tmp_path: Path) -> None:
    rows = [_good_row(i) for i in range(12)]
    for r in rows[2:11]:
        r["data_source"] = None
    with pytest.raises(DataError) as err:
        load_parquet_rows(_write(rows, tmp_path / "many.parquet"))
    assert "row 2: data_source is missing" in str(err.value) and "and 4 more bad rows" in str(err.value)


# -- templating and truncation ---------------------------------------------------------------------------------------


def test_chat_template_and_left_truncation_counts(hf_tokenizer, tmp_path: Path) -> None:
    rows = [_good_row(i) for i in (1, 22, 333, 4444, 55555)]
    rows[2]["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    lengths = [_chatml_length(r["prompt"]) for r in rows]
    limit = sorted(lengths)[2]  # the two longest prompts exceed it
    ds = PromptDataset.from_files([_write(rows, tmp_path / "p.parquet")], hf_tokenizer, max_prompt_len=limit)
    full = PromptDataset.from_files([tmp_path / "p.parquet"], hf_tokenizer, max_prompt_len=10_000)
    assert [len(it.prompt_ids) for it in full] == lengths
    assert ds.num_truncated == sum(n > limit for n in lengths) == 2
    for short, long in zip(ds, full):
        assert short.truncated == (len(long.prompt_ids) > limit)
        assert short.prompt_ids == long.prompt_ids[-limit:]  # LEFT truncation keeps the end
        assert hf_tokenizer.decode(short.prompt_ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert full[2].prompt_text.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_prompt_overflow_error_names_the_rows_and_lengths(hf_tokenizer, tmp_path: Path) -> None:
    """data.prompt_overflow = error: the same file is refused, naming each long row and its length."""
    rows = [_good_row(i) for i in (1, 22, 333, 4444, 55555)]
    lengths = [_chatml_length(r["prompt"]) for r in rows]
    limit = sorted(lengths)[2]
    path = _write(rows, tmp_path / "p.parquet")
    with pytest.raises(DataError) as err:
        PromptDataset.from_files([path], hf_tokenizer, max_prompt_len=limit, overflow="error")
    expected = ", ".join(f"{path} row {i} ({n} tokens)" for i, n in enumerate(lengths) if n > limit)
    assert f"longer than data.max_prompt_len = {limit} tokens: {expected} (data.prompt_overflow" in str(err.value)
    ok = PromptDataset.from_files([path], hf_tokenizer, max_prompt_len=max(lengths), overflow="error")
    assert ok.num_truncated == 0


def test_plain_join_without_chat_template(hf_tokenizer) -> None:
    rows = [_good_row(1)]
    rows[0]["prompt"] = [{"role": "system", "content": "Sys"}, {"role": "user", "content": "What?"}]
    ds = PromptDataset.from_rows(rows, hf_tokenizer, max_prompt_len=100, apply_chat_template=False)
    assert ds[0].prompt_text == "Sys\n\nWhat?"
    assert hf_tokenizer.decode(ds[0].prompt_ids) == "Sys\n\nWhat?"


def test_char_tokenizer_prompts_and_truncation() -> None:
    tok = CharTokenizer()
    rows = [{**_good_row(0), "prompt": [{"role": "user", "content": c}]} for c in ("07+45=", "99+99=")]
    ds = PromptDataset.from_rows(rows, tok, max_prompt_len=5)
    assert ds.num_truncated == 2
    assert tok.decode(ds[0].prompt_ids) == "7+45="  # left-truncated "<bos>Q: 07+45="
    ds = PromptDataset.from_rows(rows, tok, max_prompt_len=64)
    assert tok.decode(ds[1].prompt_ids) == "<bos>Q: 99+99=" and ds.num_truncated == 0


# -- groups ----------------------------------------------------------------------------------------------------------


def test_groups_and_unique_distinguish_ground_truths(hf_tokenizer) -> None:
    rows = [_good_row(1), _good_row(2), _good_row(1), _good_row(1, truth="3"), _good_row(2)]
    ds = PromptDataset.from_rows(rows, hf_tokenizer, max_prompt_len=64)
    assert list(ds.groups().values()) == [[0, 2], [1, 4], [3]]
    unique = ds.unique()
    assert [it.ground_truth for it in unique] == ["2", "4", "3"]
    assert [it.source for it in unique] == ["rows row 0", "rows row 1", "rows row 3"]
    keys = [prompt_key(r["prompt"], r["reward_model"]["ground_truth"]) for r in rows]
    assert [it.group_key for it in ds] == keys


# -- the iterator ----------------------------------------------------------------------------------------------------


def test_iterator_epochs_are_permutations_and_seeded() -> None:
    data = list(range(10))
    it = PromptIterator(data, seed=7)
    seq = it.take(30)
    for epoch in range(3):
        assert sorted(seq[10 * epoch : 10 * epoch + 10]) == data
    assert seq[:10] != seq[10:20]  # a new permutation per epoch
    assert PromptIterator(data, seed=7).take(30) == seq
    assert PromptIterator(data, seed=8).take(10) != seq[:10]
    assert PromptIterator(data, seed=7, shuffle=False).take(12) == data + [0, 1]


def test_iterator_state_round_trips() -> None:
    data = [f"p{i}" for i in range(13)]
    it = PromptIterator(data, seed=3)
    it.take(9)
    it.take(9)  # crosses into epoch 1
    state = it.state_dict()
    assert state["epoch"] == 1 and state["position"] == 5
    expected = it.take(25)
    resumed = PromptIterator(data, seed=3)
    resumed.load_state_dict(dict(state))
    assert resumed.take(25) == expected
    with pytest.raises(DataError, match="size = 13"):
        PromptIterator(data[:12], seed=3).load_state_dict(state)
    with pytest.raises(DataError, match="seed = 3"):
        PromptIterator(data, seed=4).load_state_dict(state)
