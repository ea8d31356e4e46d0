"""Prompt datasets in the DAPO schema: parquet via ``datasets`` (local, offline), validation, chat templates, order.

    ds = PromptDataset.from_files(["data/dapo-math-17k.parquet"], tokenizer, max_prompt_len=2048)
    it = PromptIterator(ds, seed=1234)                 # deterministic epochs; it.state_dict() goes in checkpoints
    items = it.take(1536)                              # list[PromptItem]
    evals = PromptDataset.from_files(["aime-2024.parquet"], tokenizer, 2048).unique()   # 30 of 960 rows

The DAPO schema, one row per prompt::

    prompt        list<struct<role: string, content: string>>   the chat, usually one user turn
    reward_model  struct<ground_truth: string, style: string>   ground_truth is required and non-empty
    data_source   string                                        picks the reward function (megatron_dapo.reward)
    tools         string (JSON) or list of OpenAI function declarations   optional: the tools the chat template
                  shows the model and a tool agent lets it call (megatron_dapo/rollouts/tool_agent.py)
    ability, extra_info                                          optional, carried along in PromptItem.extra

Every schema error names the file, the row and the column: ``aime-2024.parquet row 17: reward_model.ground_truth is
missing``. Prompts longer than ``max_prompt_len`` tokens are cut from the LEFT (the question's end and the generation
prompt survive) and counted in ``num_truncated``, or, with ``overflow="error"`` (``data.prompt_overflow``), refused
with an error naming the file, the rows and their lengths.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REQUIRED_COLUMNS = ("prompt", "reward_model", "data_source")
ROLES = ("system", "user", "assistant")
MAX_REPORTED_ERRORS = 5
_ENCODE_CHUNK = 1024


class DataError(ValueError):
    """Bad prompt data; the message names the file, row and column."""


# ----------------------------------------------------------------------------------------------------------------------
# Schema


def check_row(row: Mapping[str, Any]) -> str | None:
    """The first DAPO-schema problem of one row as ``"column: problem"``, or None when the row is valid."""
    prompt = row.get("prompt")
    if prompt is None:
        return "prompt is missing"
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) or len(prompt) == 0:
        kind = (
            "an empty list" if isinstance(prompt, Sequence) and not isinstance(prompt, str) else type(prompt).__name__
        )
        return f"prompt is not a chat list of {{role, content}} messages (got {kind})"
    for j, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            return f"prompt[{j}] is not a {{role, content}} message (got {type(message).__name__})"
        if message.get("role") not in ROLES:
            return f"prompt[{j}].role is {message.get('role')!r}; expected one of {', '.join(ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"prompt[{j}].content is missing or not a string"
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, Mapping):
        return "reward_model is missing" if reward_model is None else "reward_model is not a struct"
    ground_truth = reward_model.get("ground_truth")
    if ground_truth is None:
        return "reward_model.ground_truth is missing"
    if not isinstance(ground_truth, (str, int, float)) or isinstance(ground_truth, bool):
        return f"reward_model.ground_truth is a {type(ground_truth).__name__}; expected a string"
    if str(ground_truth).strip() == "":
        return "reward_model.ground_truth is empty"
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        return "data_source is missing" if source is None else f"data_source is not a non-empty string ({source!r})"
    try:
        row_tools(row)
    except ValueError as e:
        return f"tools: {e}"
    return None


def row_tools(row: Mapping[str, Any]) -> list[dict] | None:
    """The row's tool declarations (the ``tools`` column: JSON text or a list of OpenAI function declarations,
    ``{"type": "function", "function": {"name": ..., "parameters": {...}}}``); None when it has none."""
    tools = row.get("tools")
    if tools is None or (isinstance(tools, (str, bytes)) and not tools.strip()):
        return None
    if isinstance(tools, (str, bytes)):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e.msg} at character {e.pos})") from e
    if isinstance(tools, Mapping) or not isinstance(tools, Sequence):
        raise ValueError(f"expected a list of function declarations, got {type(tools).__name__}")
    out = []
    for j, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"[{j}] has no function name")
        out.append(dict(tool))
    return out


def check_columns(columns: Iterable[str], name: str) -> None:
    columns = list(columns)
    for column in REQUIRED_COLUMNS:
        if column not in columns:
            raise DataError(f"{name}: column {column!r} is missing (columns: {', '.join(columns)})")


def validate_rows(rows: Iterable[Mapping[str, Any]], name: str) -> None:
    """Raise ``DataError`` naming the first bad rows (``{name} row {i}: {column}: ...``), if any."""
    errors, count = [], 0
    for i, row in enumerate(rows):
        problem = check_row(row)
        if problem:
            count += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(f"{name} row {i}: {problem}")
    if errors:
        more = f"\n  ... and {count - len(errors)} more bad rows" if count > len(errors) else ""
        raise DataError("\n  ".join(errors) + more)


def prompt_key(messages: Sequence[Mapping[str, Any]], ground_truth: Any) -> str:
    """A stable id of a problem: its chat messages plus its ground truth (for dedup and grouping)."""
    payload = json.dumps(
        [[[m.get("role"), m.get("content")] for m in messages], str(ground_truth)], ensure_ascii=False
    ).encode()
    return hashlib.sha1(payload).hexdigest()


# ----------------------------------------------------------------------------------------------------------------------
# Loading


def load_parquet_rows(path: str | Path) -> list[dict]:
    """All rows of one parquet file as dicts, via ``datasets`` (local file, no hub); validated."""
    import datasets

    name = str(path)
    if not Path(path).is_file():
        raise DataError(f"{name}: no such file")
    quiet = not datasets.utils.are_progress_bars_disabled()
    if quiet:
        datasets.disable_progress_bars()
    # In memory, with a throw-away cache dir: nothing is left in (or needs write access to) the HF cache.
    try:
        with tempfile.TemporaryDirectory(prefix="dapo-parquet-") as cache_dir:
            table = datasets.Dataset.from_parquet(name, keep_in_memory=True, cache_dir=cache_dir)
    except Exception as e:
        raise DataError(f"{name}: cannot read as parquet: {e}") from e
    finally:
        if quiet:
            datasets.enable_progress_bars()
    check_columns(table.column_names, name)
    rows = table.to_list()
    validate_rows(rows, name)
    return rows


def load_prompt_rows(files: Sequence[str | Path]) -> list[tuple[str, int, dict]]:
    """``(file, row index in file, row)`` for every row of every file, validated."""
    if not files:
        raise DataError("no prompt files given")
    out = []
    for path in files:
        out.extend((str(path), i, row) for i, row in enumerate(load_parquet_rows(path)))
    return out


def write_parquet_atomic(data: Any, path: str | Path) -> Path:
    """Write a ``pyarrow.Table`` (or a list of row dicts) to ``path`` via a temporary file in the same directory and
    a rename, so a reader never sees a half-written file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = data if isinstance(data, pa.Table) else pa.Table.from_pylist(list(data))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


# ----------------------------------------------------------------------------------------------------------------------
# Items and the dataset


@dataclass
class PromptItem:
    """One prompt, tokenized. ``index`` is its position in the dataset; ``group_key`` identifies the problem."""

    index: int
    prompt_ids: list[int]
    prompt_text: str  # the rendered prompt before truncation
    ground_truth: str
    data_source: str
    messages: list[dict]
    reward_style: str | None = None
    truncated: bool = False
    group_key: str = ""
    source: str = ""  # "file row N"
    extra: dict = field(default_factory=dict)  # ability, extra_info, ...

    @property
    def reward_model(self) -> dict:
        return {"ground_truth": self.ground_truth, "style": self.reward_style}


def render_prompt(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], apply_chat_template: bool, tools: list | None = None
) -> str:
    """The prompt text: the tokenizer's chat template with the generation prompt (and the row's tool declarations),
    or the contents joined."""
    if not apply_chat_template:
        return "\n\n".join(m["content"] for m in messages)
    chat = [{"role": m["role"], "content": m["content"]} for m in messages]
    try:
        if tools:
            return tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
        return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    except ValueError as e:
        if "chat_template" in str(e) or "chat template" in str(e):
            raise DataError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat template: "
                "set data.apply_chat_template=false to join the messages as plain text"
            ) from e
        raise


def encode_texts(tokenizer: Any, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
    """Token ids of each text (batched through the tokenizer's ``__call__``)."""
    out: list[list[int]] = []
    for start in range(0, len(texts), _ENCODE_CHUNK):
        chunk = list(texts[start : start + _ENCODE_CHUNK])
        out.extend(list(ids) for ids in tokenizer(chunk, add_special_tokens=add_special_tokens)["input_ids"])
    return out


class PromptDataset:
    """Tokenized prompts (``PromptItem``) from DAPO-schema rows; see the module docstring."""

    def __init__(self, items: list[PromptItem], name: str = "prompts"):
        self.items = items
        self.name = name

    @classmethod
    def from_files(
        cls,
        files: Sequence[str | Path],
        tokenizer: Any,
        max_prompt_len: int,
        apply_chat_template: bool = True,
        overflow: str = "truncate",
    ) -> PromptDataset:
        rows = load_prompt_rows(files)
        return cls._build(rows, tokenizer, max_prompt_len, apply_chat_template, ", ".join(map(str, files)), overflow)

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        max_prompt_len: int,
        apply_chat_template: bool = True,
        name: str = "rows",
    ) -> PromptDataset:
        """From in-memory DAPO rows (e.g. the synthetic task); validated like a file called ``name``."""
        validate_rows(rows, name)
        return cls._build(
            [(name, i, dict(r)) for i, r in enumerate(rows)], tokenizer, max_prompt_len, apply_chat_template, name
        )

    @classmethod
    def _build(
        cls, rows, tokenizer, max_prompt_len: int, apply_chat_template: bool, name: str, overflow: str = "truncate"
    ) -> PromptDataset:
        if max_prompt_len < 1:
            raise DataError(f"max_prompt_len = {max_prompt_len}: must be >= 1")
        tools = [row_tools(row) for _, _, row in rows]
        texts = [render_prompt(tokenizer, row["prompt"], apply_chat_template, t) for (_, _, row), t in zip(rows, tools)]
        # Chat templates write their own special tokens; plain text gets the tokenizer's defaults (e.g. BOS).
        all_ids = encode_texts(tokenizer, texts, add_special_tokens=not apply_chat_template)
        if overflow == "error":
            too_long = [
                (f"{file} row {i}", len(ids)) for (file, i, _), ids in zip(rows, all_ids) if len(ids) > max_prompt_len
            ]
            if too_long:
                shown = ", ".join(f"{where} ({n} tokens)" for where, n in too_long[:MAX_REPORTED_ERRORS])
                more = f" and {len(too_long) - MAX_REPORTED_ERRORS} more" if len(too_long) > MAX_REPORTED_ERRORS else ""
                raise DataError(
                    f"prompts longer than data.max_prompt_len = {max_prompt_len} tokens: {shown}{more} "
                    "(data.prompt_overflow = error; 'truncate' cuts them from the left)"
                )
        items = []
        for index, ((file, row_index, row), text, ids, row_tool) in enumerate(zip(rows, texts, all_ids, tools)):
            messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
            truth = str(row["reward_model"]["ground_truth"])
            extra = {k: v for k, v in row.items() if k not in (*REQUIRED_COLUMNS, "__index_level_0__")}
            if row_tool is not None:
                extra["tools"] = row_tool  # parsed: what a tool agent reads
            items.append(
                PromptItem(
                    index=index,
                    prompt_ids=ids[-max_prompt_len:],
                    prompt_text=text,
                    ground_truth=truth,
                    data_source=row["data_source"],
                    messages=messages,
                    reward_style=row["reward_model"].get("style"),
                    truncated=len(ids) > max_prompt_len,
                    group_key=prompt_key(messages, truth),
                    source=f"{file} row {row_index}",
                    extra=extra,
                )
            )
        return cls(items, name)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]

    def __iter__(self) -> Iterator[PromptItem]:
        return iter(self.items)

    @property
    def num_truncated(self) -> int:
        return sum(item.truncated for item in self.items)

    def groups(self) -> dict[str, list[int]]:
        """``{group_key: [indices]}`` of identical problems (prompt + ground truth), in order of first appearance."""
        out: dict[str, list[int]] = {}
        for item in self.items:
            out.setdefault(item.group_key, []).append(item.index)
        return out

    def select(self, indices: Iterable[int]) -> PromptDataset:
        """A new dataset of the given items, re-indexed from 0 (their ``source`` still names file and row)."""
        picked = [self.items[i] for i in indices]
        items = [PromptItem(**{**vars(item), "index": j}) for j, item in enumerate(picked)]
        return PromptDataset(items, self.name)

    def unique(self) -> PromptDataset:
        """One item per distinct problem (eval sets repeat each problem, e.g. AIME-2024: 30 problems x 32)."""
        return self.select(indices[0] for indices in self.groups().values())

    def stats(self) -> dict[str, float]:
        lengths = [len(item.prompt_ids) for item in self.items] or [0]
        return {
            "rows": float(len(self.items)),
            "unique_problems": float(len(self.groups())),
            "truncated": float(self.num_truncated),
            "prompt_len_mean": float(np.mean(lengths)),
            "prompt_len_max": float(max(lengths)),
        }


# ----------------------------------------------------------------------------------------------------------------------
# Deterministic, resumable order


class PromptIterator:
    """An endless walk over a dataset, one seeded permutation per epoch; batches may span epochs.

    The cursor (``epoch``, ``position``) is all the state: ``load_state_dict(state_dict())`` on a fresh iterator over
    the same dataset continues with exactly the same next prompts.
    """

    def __init__(self, dataset: PromptDataset | Sequence[Any], seed: int, shuffle: bool = True):
        if len(dataset) == 0:
            raise DataError("cannot iterate over an empty prompt dataset")
        self.dataset = dataset
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    def order(self, epoch: int) -> np.ndarray:
        """The index order of ``epoch``: a permutation seeded by (seed, epoch), or 0..n-1 without shuffle."""
        if self._order_epoch != epoch:
            n = len(self.dataset)
            self._order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    def next_indices(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            order = self.order(self.epoch)
            step = min(count - len(out), len(order) - self.position)
            out.extend(int(i) for i in order[self.position : self.position + step])
            self.position += step
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def take(self, count: int) -> list[Any]:
        """The next ``count`` items."""
        return [self.dataset[i] for i in self.next_indices(count)]

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> Any:
        return self.take(1)[0]

    def state_dict(self) -> dict[str, int | bool]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "size": len(self.dataset),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the cursor; the dataset size, seed and shuffle must match the ones it was saved with."""
        for key, mine in (("size", len(self.dataset)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise DataError(
                    f"prompt iterator state: {key} = {state[key]!r} in the checkpoint but {mine!r} now; "
                    "resuming would not continue with the same prompts"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.dataset):
            raise DataError(f"prompt iterator state: epoch {epoch}, position {position} out of range")
        self.epoch, self.position = epoch, position
