"""The char tokenizer and the synthetic add2 task: held-out splits, supervised targets that the DAPO rule accepts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo.data.dataset import PromptDataset, check_row, load_parquet_rows
from megatron_dapo.data.synthetic import (
    DATA_SOURCE,
    add2_splits,
    make_add2_datasets,
    supervised_target_ids,
    supervised_target_text,
    write_add2_parquet,
)
from megatron_dapo.data.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer, load_tokenizer
from megatron_dapo.models.arch import load_arch
from megatron_dapo.reward.math_dapo import compute_score

PROBLEM = re.compile(r"(\d\d)\+(\d\d)")


def _operands(row: dict) -> tuple[int, int]:
    a, b = PROBLEM.search(row["prompt"][0]["content"]).groups()
    return int(a), int(b)


# -- char tokenizer --------------------------------------------------------------------------------------------------


def test_char_tokenizer_round_trip_and_special_ids() -> None:
    tok = CharTokenizer()
    text = "Q: 07+45= Answer: 52\n"
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3
    assert tok.encode("<bos>Q<eos>") == [tok.bos_token_id, tok.encode("Q")[0], tok.eos_token_id]
    assert tok.encode("Q", add_special_tokens=True) == [tok.bos_token_id, *tok.encode("Q")]
    assert tok.decode([tok.bos_token_id, *tok.encode("12"), tok.eos_token_id], skip_special_tokens=True) == "12"
    assert tok.decode([tok.vocab_size + 3]) == "<unk>"  # padded model vocabulary
    assert tok.batch_decode([tok.encode("1"), tok.encode("2")]) == ["1", "2"]


def test_char_vocab_fits_the_tiny_model() -> None:
    tok = CharTokenizer()
    assert 20 <= tok.vocab_size <= load_arch("tiny").vocab_size


def test_char_chat_template() -> None:
    tok = CharTokenizer()
    messages = [{"role": "user", "content": "07+45="}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == "<bos>Q: 07+45="
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == [tok.bos_token_id, *tok.encode("Q: 07+45=")]
    with pytest.raises(ValueError, match="unknown role"):
        tok.apply_chat_template([{"role": "tool", "content": "1"}])


def test_char_tokenizer_rejects_unknown_characters_by_name() -> None:
    with pytest.raises(ValueError, match=r"character 'S' at position 0"):
        CharTokenizer().encode("Solve 1+1")


def test_char_tokenizer_save_load(tmp_path: Path) -> None:
    tok = CharTokenizer()
    tok.save_pretrained(tmp_path / "ckpt")
    data = json.loads((tmp_path / "ckpt" / CHAR_TOKENIZER_FILE).read_text())
    assert data["type"] == "char"
    loaded = load_tokenizer(tmp_path / "ckpt")
    assert isinstance(loaded, CharTokenizer) and loaded == tok and loaded.vocab == tok.vocab
    assert isinstance(load_tokenizer(None), CharTokenizer) and isinstance(load_tokenizer("char"), CharTokenizer)
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        load_tokenizer(tmp_path / "no-such-dir")


# -- the task --------------------------------------------------------------------------------------------------------


def test_splits_are_held_out_seeded_and_correct() -> None:
    train, evals = add2_splits(train_size=12_000, eval_size=300, seed=5)
    assert len(train) == 12_000 and len(evals) == 300
    train_problems = {_operands(r) for r in train}
    eval_problems = [_operands(r) for r in evals]
    assert len(set(eval_problems)) == 300  # distinct eval problems
    assert not train_problems & set(eval_problems)  # held out
    assert len(train_problems) == 10_000 - 300  # 12,000 rows cycle through every other problem
    for row in train[:500] + evals:
        a, b = _operands(row)
        assert row["reward_model"]["ground_truth"] == str(a + b)
        assert row["prompt"][0]["content"] == f"{a:02d}+{b:02d}="
        assert row["data_source"] == DATA_SOURCE and check_row(row) is None
    assert add2_splits(100, 10, seed=5) == add2_splits(100, 10, seed=5)
    assert add2_splits(100, 10, seed=6)[1] != add2_splits(100, 10, seed=5)[1]
    with pytest.raises(ValueError, match="eval_size"):
        add2_splits(10, 0, seed=0)


def test_supervised_targets_score_plus_one() -> None:
    tok = CharTokenizer()
    train, evals = add2_splits(train_size=200, eval_size=50, seed=1)
    for row in train + evals:
        truth = row["reward_model"]["ground_truth"]
        ids = supervised_target_ids(tok, truth)
        assert ids[-1] == tok.eos_token_id
        text = tok.decode(ids, skip_special_tokens=True)
        assert text == supervised_target_text(truth) == f" Answer: {sum(_operands(row))}"
        assert compute_score(text, truth)["score"] == 1.0
        assert compute_score(f" Answer: {sum(_operands(row)) + 1}", truth)["score"] == -1.0


def test_dapo_wording_and_parquet_round_trip(tmp_path: Path) -> None:
    train_path, eval_path = write_add2_parquet(tmp_path, train_size=40, eval_size=8, seed=2, wording="dapo")
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporary files
    rows = load_parquet_rows(train_path)
    assert len(rows) == 40 and len(load_parquet_rows(eval_path)) == 8
    content = rows[0]["prompt"][0]["content"]
    assert content.startswith("Solve the following math problem step by step.")
    assert content.endswith('Remember to put your answer on its own line after "Answer:".')
    a, b = _operands(rows[0])
    assert rows[0]["reward_model"]["ground_truth"] == str(a + b)
    assert pq.read_table(train_path).column("extra_info").to_pylist()[3]["index"] == 3


def test_make_datasets_with_the_char_tokenizer() -> None:
    tok = CharTokenizer()
    train, evals = make_add2_datasets(tok, train_size=64, eval_size=16, seed=0, max_prompt_len=32)
    assert isinstance(train, PromptDataset) and len(train) == 64 and len(evals) == 16
    assert train.num_truncated == 0
    for item in list(train)[:8]:
        a, b = PROBLEM.search(item.messages[0]["content"]).groups()
        assert tok.decode(item.prompt_ids) == f"<bos>Q: {a}+{b}="
        assert item.ground_truth == str(int(a) + int(b))


def test_build_prompt_datasets_from_config(tmp_path: Path) -> None:
    from megatron_dapo.config.run_config import DapoConfig, DataConfig, EvalConfig, TrainConfig
    from megatron_dapo.data.sources import build_prompt_datasets

    _, eval_path = write_add2_parquet(tmp_path, train_size=10, eval_size=6, seed=9)
    repeated = pq.read_table(eval_path)
    pq.write_table(pa.concat_tables([repeated, repeated, repeated]), tmp_path / "rep.parquet")  # each problem 3x
    cfg = DapoConfig(
        data=DataConfig(synthetic="add2", synthetic_train_size=50, synthetic_eval_size=12, max_prompt_len=32),
        eval=EvalConfig(files=[str(tmp_path / "rep.parquet")]),
        train=TrainConfig(seed=4),
    )
    train, evals = build_prompt_datasets(cfg, CharTokenizer())
    assert len(train) == 50 and sorted(evals) == sorted([DATA_SOURCE, "rep"])
    assert len(evals[DATA_SOURCE]) == 12 and len(evals["rep"]) == 6  # de-duplicated to one item per problem
    expected_train, _ = add2_splits(50, 12, seed=4)
    assert [it.messages for it in train] == [r["prompt"] for r in expected_train]


def test_stratified_take_is_even_while_the_pools_allow_and_names_the_shortfall():
    from megatron_dapo.data.synthetic import stratified_take

    pools = {2: ["a1", "a2"], 3: ["b1", "b2", "b3", "b4"], 4: ["c1", "c2", "c3", "c4"]}
    # round-robin: the small pool gives all it has, the others share the rest evenly, in stratum order
    assert stratified_take(pools, 8, "{have}") == ["a1", "a2", "b1", "b2", "b3", "c1", "c2", "c3"]
    assert stratified_take(pools, 3, "{have}") == ["a1", "b1", "c1"]
    with pytest.raises(ValueError, match="^only 10 here$"):
        stratified_take(pools, 11, "only {have} here")
