"""tools/prepare_data.py: de-duplication by prompt + ground truth, invalid-row counts, overwrite guard, atomic write."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo.data.dataset import load_parquet_rows

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "prepare_data.py"

pytestmark = pytest.mark.timeout(120)


def _row(problem: int, truth: str) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": f"Problem {problem}: what is {problem} squared?"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": truth, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": str(problem)},
    }


def _make_input(path: Path) -> tuple[list[dict], dict]:
    """Problems repeated a varying number of times, shuffled, with invalid rows and a same-prompt/other-truth row."""
    rng = random.Random(0)
    rows = [_row(p, str(p * p)) for p in range(25) for _ in range(1 + p % 7)]
    rows += [_row(3, "10")] * 4  # same prompt, different ground truth: a distinct problem
    rng.shuffle(rows)
    bad = [
        {**_row(100, "1"), "reward_model": {"ground_truth": None, "style": "rule"}},
        {**_row(101, "1"), "prompt": []},
    ]
    rows.insert(5, bad[0])
    rows.insert(40, bad[1])
    pq.write_table(pa.Table.from_pylist(rows), path)
    # Independent expectations.
    first, invalid = {}, 0
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        if truth is None or not row["prompt"]:
            invalid += 1
            continue
        first.setdefault((row["prompt"][0]["content"], truth), row)
    expected = {"rows_in": len(rows), "unique": len(first), "invalid": invalid}
    expected["duplicates_dropped"] = len(rows) - invalid - len(first)
    return list(first.values()), expected


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=100)


def test_dedup_counts_and_output(tmp_path: Path) -> None:
    src, out = tmp_path / "dapo-math.parquet", tmp_path / "out" / "dedup.parquet"
    kept, expected = _make_input(src)
    assert expected["unique"] == 26 and expected["invalid"] == 2
    proc = _run("--input", str(src), "--output", str(out), "--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {k: report[k] for k in expected} == expected
    assert "row 5: reward_model.ground_truth is missing" in proc.stderr
    assert "row 40: prompt is not a chat list" in proc.stderr
    rows = load_parquet_rows(out)  # the output validates
    assert [r["prompt"][0]["content"] for r in rows] == [r["prompt"][0]["content"] for r in kept]  # first occurrences
    assert [r["reward_model"]["ground_truth"] for r in rows] == [r["reward_model"]["ground_truth"] for r in kept]
    assert rows[0]["extra_info"] == kept[0]["extra_info"] and rows[0]["ability"] == "MATH"
    assert sorted(p.name for p in out.parent.iterdir()) == ["dedup.parquet"]  # no temporary file left


def test_refuses_to_overwrite_without_flag(tmp_path: Path) -> None:
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    _make_input(src)
    out.write_bytes(b"precious")
    proc = _run("--input", str(src), "--output", str(out), "--no-progress")
    assert proc.returncode == 1 and "--overwrite" in proc.stderr
    assert out.read_bytes() == b"precious"
    proc = _run("--input", str(src), "--output", str(out), "--no-progress", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert "26 unique kept" in proc.stdout and "2 invalid rows" in proc.stdout
    assert len(load_parquet_rows(out)) == 26


def test_strict_writes_nothing_and_bad_input_is_named(tmp_path: Path) -> None:
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    _make_input(src)
    proc = _run("--input", str(src), "--output", str(out), "--no-progress", "--strict")
    assert proc.returncode == 1 and "2 invalid rows" in proc.stderr and "row 5" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet"]
    no_truth = tmp_path / "no-truth.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "x", "prompt": [{"role": "user", "content": "q"}]}]), no_truth)
    proc = _run("--input", str(no_truth), "--output", str(out), "--no-progress")
    assert proc.returncode == 1 and "column 'reward_model' is missing" in proc.stderr
    proc = _run("--input", str(tmp_path / "missing.parquet"), "--output", str(out))
    assert proc.returncode == 1 and "missing.parquet: no such file" in proc.stderr
