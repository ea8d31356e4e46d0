#!/usr/bin/env python
"""De-duplicate and validate a DAPO-schema prompt parquet (e.g. the public DAPO-Math-17k file).

    python tools/prepare_data.py --input dapo-math-17k.parquet --output data/dapo-math-17k.dedup.parquet

The public DAPO-Math-17k parquet repeats each of its ~17.4k prompts about 100 times. This keeps the first row of each
distinct problem (same chat messages and same ground truth), drops rows that break the schema (reporting the first
few by row number and column), and writes the result atomically (temporary file + rename). It streams the input in
batches, so memory stays bounded for large files. An existing output is only replaced with ``--overwrite``.
Invalid rows are dropped and counted; with ``--strict`` any invalid row fails the run. Exit status: 0 on success,
1 for bad arguments or input (the message names the file, row and column).

    python tools/prepare_data.py --tool-example data/tool_arith.parquet --rows 256

writes an example of the agentic format instead: multiplication problems too large to do in one's head, each row
declaring the calculator tool in its ``tools`` column (JSON of OpenAI function declarations), for the tool agent
(``rollout.generate: megatron_dapo.rollouts.tool_agent:generate``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from megatron_dapo.data.dataset import REQUIRED_COLUMNS, check_row, prompt_key

DROPPED_COLUMNS = ("__index_level_0__",)  # a pandas index: meaningless once rows are dropped
BATCH_ROWS = 8192
MAX_REPORTED = 10


@dataclass
class PrepareReport:
    input: str
    output: str
    rows_in: int = 0
    unique: int = 0
    duplicates_dropped: int = 0
    invalid: int = 0
    invalid_examples: list[str] = field(default_factory=list)
    seconds: float = 0.0


class PrepareError(Exception):
    """Bad arguments or input; the message says which."""


def _output_schema(schema: pa.Schema) -> pa.Schema:
    keep = [f for f in schema if f.name not in DROPPED_COLUMNS]
    return pa.schema(keep)  # no pandas metadata: it would describe the dropped index


def prepare(
    input_path: str | Path,
    output_path: str | Path,
    overwrite: bool = False,
    strict: bool = False,
    progress: bool = True,
    console: Console | None = None,
) -> PrepareReport:
    """Stream ``input_path``, keep the first valid row of each problem, write ``output_path`` atomically.

    Invalid rows are dropped and counted (``strict``: any invalid row is an error and nothing is written).
    """
    input_path, output_path = Path(input_path), Path(output_path)
    if not input_path.is_file():
        raise PrepareError(f"--input {input_path}: no such file")
    if output_path.exists() and not overwrite:
        raise PrepareError(f"--output {output_path}: already exists (pass --overwrite to replace it)")
    try:
        source = pq.ParquetFile(input_path)
    except Exception as e:
        raise PrepareError(f"--input {input_path}: cannot read as parquet: {e}") from e
    missing = [c for c in REQUIRED_COLUMNS if c not in source.schema_arrow.names]
    if missing:
        raise PrepareError(
            f"--input {input_path}: column {missing[0]!r} is missing (columns: {', '.join(source.schema_arrow.names)})"
        )
    schema = _output_schema(source.schema_arrow)
    report = PrepareReport(str(input_path), str(output_path))
    seen: set[str] = set()
    start = time.monotonic()
    output_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{output_path.name}.", suffix=".tmp", dir=output_path.parent)
    os.close(fd)
    try:
        with (
            pq.ParquetWriter(tmp, schema) as writer,
            Progress(
                TextColumn("dedup {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=console,
                disable=not progress,
                transient=True,
            ) as bar,
        ):
            task = bar.add_task(input_path.name, total=source.metadata.num_rows)
            for batch in source.iter_batches(batch_size=BATCH_ROWS):
                table = pa.Table.from_batches([batch]).select(schema.names)
                keep = []
                for offset, row in enumerate(table.to_pylist()):
                    row_index = report.rows_in + offset
                    problem = check_row(row)
                    if problem:
                        report.invalid += 1
                        if len(report.invalid_examples) < MAX_REPORTED:
                            report.invalid_examples.append(f"{input_path.name} row {row_index}: {problem}")
                        continue
                    key = prompt_key(row["prompt"], row["reward_model"]["ground_truth"])
                    if key in seen:
                        report.duplicates_dropped += 1
                        continue
                    seen.add(key)
                    keep.append(offset)
                if keep:
                    writer.write_table(table.take(keep).cast(schema))
                report.rows_in += table.num_rows
                bar.advance(task, table.num_rows)
        report.unique = len(seen)
        if strict and report.invalid:
            first = report.invalid_examples[0]
            raise PrepareError(f"--strict: {report.invalid} invalid rows, nothing written; first: {first}")
        if report.unique == 0:
            raise PrepareError(f"--input {input_path}: no valid rows ({report.invalid} invalid of {report.rows_in})")
        os.replace(tmp, output_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    report.seconds = time.monotonic() - start
    return report


TOOL_PROMPT = "What is {a} * {b}? Use the calculator, then end with a line 'Answer: N'."


def tool_example_rows(rows: int, seed: int = 0) -> list[dict]:
    """Rows of the agentic format: the DAPO schema plus ``tools`` (JSON text) declaring the calculator."""
    import random

    from megatron_dapo.rollouts.tools import TOOL_SCHEMAS

    rng = random.Random(seed)
    tools = json.dumps([TOOL_SCHEMAS["calculator"]])
    out = []
    for i in range(rows):
        a, b = rng.randint(1000, 99999), rng.randint(100, 9999)
        out.append(
            {
                "prompt": [{"role": "user", "content": TOOL_PROMPT.format(a=a, b=b)}],
                "reward_model": {"ground_truth": str(a * b), "style": "rule"},
                "data_source": "tool_arith",
                "tools": tools,
                "extra_info": {"index": i, "a": a, "b": b},
            }
        )
    return out


def write_tool_example(output: str | Path, rows: int, overwrite: bool) -> Path:
    output_path = Path(output)
    if output_path.exists() and not overwrite:
        raise PrepareError(f"{output_path} exists (use --overwrite to replace it)")
    output_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{output_path.name}.", suffix=".tmp", dir=output_path.parent)
    os.close(fd)
    pq.write_table(pa.Table.from_pylist(tool_example_rows(rows)), tmp)
    os.replace(tmp, output_path)
    return output_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", help="DAPO-schema parquet to read")
    parser.add_argument("--output", help="de-duplicated parquet to write")
    parser.add_argument("--tool-example", metavar="OUT", help="write an example of the agentic format to OUT instead")
    parser.add_argument("--rows", type=int, default=256, help="--tool-example: how many rows")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument("--strict", action="store_true", help="fail (write nothing) if any row is invalid")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    console = Console(stderr=True, soft_wrap=True)  # never wrap messages that name files and rows
    if args.tool_example:
        try:
            path = write_tool_example(args.tool_example, args.rows, args.overwrite)
        except PrepareError as e:
            console.print(f"[red]error:[/red] {e}", highlight=False)
            return 1
        print(f"{path}: {args.rows} rows of the agentic format (tools: calculator)")
        return 0
    if not args.input or not args.output:
        parser.error("--input and --output are required (or --tool-example OUT)")
    try:
        report = prepare(args.input, args.output, args.overwrite, args.strict, not args.no_progress, console)
    except PrepareError as e:
        console.print(f"[red]error:[/red] {e}", highlight=False)
        return 1
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        print(
            f"{report.input}: {report.rows_in} rows in, {report.unique} unique kept, "
            f"{report.duplicates_dropped} duplicates dropped, {report.invalid} invalid rows "
            f"-> {report.output} ({report.seconds:.1f} s)"
        )
    for example in report.invalid_examples:
        console.print(f"  invalid: {example}", highlight=False)
    if report.invalid > len(report.invalid_examples):
        console.print(f"  ... and {report.invalid - len(report.invalid_examples)} more invalid rows", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
