"""Metrics: a crash-safe JSONL log (+ tensorboard, optional wandb), eval metrics (avg@k / pass@k / maj@k), timers.

    logger = MetricsLogger(run_dir, resume=resumed_step)   # resumed_step: int, or False for a fresh run
    with Timer("rollout", metrics):                        # metrics["time/rollout_s"] += elapsed seconds
        ...
    metrics.update(eval_metrics(records))                  # eval/<source>/avg@k, pass@k, maj@k
    logger.log(step, metrics)
    logger.close()

``run_dir/metrics.jsonl`` holds one JSON object per line, each with an integer ``step`` and float values
(non-finite values are written as ``null`` and read back as NaN). Every line is flushed and fsynced; a resumed run
first cuts a torn last line and every entry past the checkpoint step, so the file never holds a step twice.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_id.txt"


# ----------------------------------------------------------------------------------------------------------------------
# Values


def to_float(key: str, value: Any) -> float:
    """A Python/numpy/torch scalar (or one-element tensor/array) as a float; anything else: an error naming ``key``."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "numel") and hasattr(value, "item"):  # torch.Tensor, without importing torch
        if value.numel() != 1:
            raise ValueError(f"metric {key!r}: expected a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().float().item() if hasattr(value, "detach") else value.item())
    if hasattr(value, "size") and hasattr(value, "item"):  # numpy array / scalar
        if value.size != 1:
            raise ValueError(f"metric {key!r}: expected a scalar, got an array of shape {getattr(value, 'shape', '?')}")
        return float(value.item())
    raise ValueError(f"metric {key!r}: expected a number, got {type(value).__name__} {value!r}")


def _json_value(x: float) -> float | None:
    return x if math.isfinite(x) else None


# ----------------------------------------------------------------------------------------------------------------------
# JSONL file


def _cut_jsonl(path: Path, max_step: int | None) -> int:
    """Drop a torn trailing line (no final newline) and, if ``max_step`` is given, every entry with step > max_step.

    Rewrites the file atomically (temp file + rename) only when something is dropped; returns the lines dropped.
    """
    data = path.read_bytes()
    lines = data.split(b"\n")
    complete, tail = lines[:-1], lines[-1]  # tail is b"" when the file ends with a newline
    dropped = 1 if tail.strip() else 0
    kept: list[bytes] = []
    for lineno, raw in enumerate(complete, 1):
        if not raw.strip():
            continue
        if max_step is not None:
            try:
                step = json.loads(raw)["step"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a metrics entry ({e}): {raw[:200]!r}") from e
            if step > max_step:
                dropped += 1
                continue
        kept.append(raw)
    if dropped or len(kept) != len(complete):
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(line + b"\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


def read_metrics(path: str | Path) -> list[dict]:
    """Entries of a metrics JSONL file (or a run directory holding one), sorted by step, ``null`` read as NaN.

    Lines with the same step are merged (later keys win). A torn last line (a run killed mid-write, or one being
    written right now) is skipped; a bad line elsewhere is an error naming the file and line.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}")
    lines = path.read_text().split("\n")
    by_step: dict[int, dict] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            step = int(entry["step"])
        except (ValueError, KeyError, TypeError) as e:
            if lineno == len(lines):  # the last line has no newline: torn, or being written
                continue
            raise ValueError(f"{path}:{lineno}: not a metrics entry ({e}): {line[:200]!r}") from e
        merged = by_step.setdefault(step, {"step": step})
        for k, v in entry.items():
            if k != "step":
                merged[k] = float("nan") if v is None else v
    return [by_step[s] for s in sorted(by_step)]


# ----------------------------------------------------------------------------------------------------------------------
# Logger


class MetricsLogger:
    """Append metrics to ``run_dir/metrics.jsonl`` (flushed + fsynced per line), tensorboard, and optionally wandb.

    ``resume``: ``False`` starts a fresh log (an existing file is kept as ``metrics.jsonl.prev``); ``True`` appends
    after the complete lines already there; an int ``s`` (the checkpoint step resumed from) also drops the entries
    with step > s, which the interrupted run logged after its last checkpoint.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        config: Any = None,
        resume: bool | int = False,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.resume_step: int | None = None if isinstance(resume, bool) else int(resume)
        if self.path.exists():
            if resume is False:
                os.replace(self.path, self.path.with_name(METRICS_FILE + ".prev"))
            else:
                _cut_jsonl(self.path, self.resume_step)
        self._file = open(self.path, "a", encoding="utf-8")  # closed in close()
        self._use_tb = tensorboard
        self._tb = None
        self._config = _config_dict(config)
        self._wandb = None
        if wandb_project:
            self._wandb = _init_wandb(self.run_dir, wandb_project, self._config, resume is not False)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """Write one entry for ``step``; returns it (floats, with ``step``)."""
        if self._file is None:
            raise RuntimeError(f"MetricsLogger({self.run_dir}) is closed")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise ValueError(f"metrics step must be an integer, got {step!r}")
        entry: dict[str, Any] = {"step": int(step)}
        for key, value in metrics.items():
            if not isinstance(key, str) or not key or key == "step":
                raise ValueError(f"bad metric name {key!r} (non-empty strings other than 'step')")
            entry[key] = to_float(key, value)
        line = json.dumps({k: (v if k == "step" else _json_value(v)) for k, v in entry.items()}, allow_nan=False)
        self._file.write(line + "\n")  # one write per line: a kill leaves at most a torn tail, cut on resume
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._use_tb:
            writer = self._tensorboard()
            for key, value in entry.items():
                if key != "step":
                    writer.add_scalar(key, value, global_step=int(step))
            writer.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in entry.items() if k != "step"}, step=int(step))
        return entry

    def _tensorboard(self):
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter  # lazy: pulls in tensorboard

            # purge_step hides events the interrupted run wrote after the checkpoint we resumed from
            purge = None if self.resume_step is None else self.resume_step + 1
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=purge)
            if self._config and self.resume_step is None:
                self._tb.add_text("config", "```\n" + json.dumps(self._config, indent=2, default=str) + "\n```")
        return self._tb

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _config_dict(config: Any) -> dict | None:
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(f"MetricsLogger config: expected a dataclass or a mapping, got {type(config).__name__}")


def _init_wandb(run_dir: Path, project: str, config: dict | None, resume: bool):
    try:
        import wandb
    except ImportError as e:
        raise ImportError(
            f"train.wandb_project = {project!r} but wandb is not installed: `pip install wandb` "
            "or set train.wandb_project=null"
        ) from e
    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if resume and id_file.is_file() else wandb.util.generate_id()
    id_file.write_text(run_id + "\n")
    return wandb.init(
        project=project, name=run_dir.name, id=run_id, resume="allow", dir=str(run_dir), config=config or {}
    )


# ----------------------------------------------------------------------------------------------------------------------
# Timing and memory


def memory_metrics() -> dict[str, float]:
    """``mem/rss_peak_gib``: this process's peak resident memory so far (the actor's rank); ``mem/children_rss_gib``:
    what its child processes hold now (the rollout servers it started, with their workers), in GiB."""
    import resource

    import psutil

    children = 0
    for child in psutil.Process().children(recursive=True):
        try:
            children += child.memory_info().rss
        except psutil.Error:  # exited meanwhile
            pass
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"mem/rss_peak_gib": peak_kib / 2**20, "mem/children_rss_gib": children / 2**30}


class Timer:
    """``with Timer("rollout", metrics): ...`` adds the elapsed seconds to ``metrics["time/rollout_s"]``.

    The time is also available as ``timer.seconds``; ``out`` may be omitted.
    """

    def __init__(self, name: str, out: dict | None = None):
        self.name = name
        self.key = f"time/{name}_s"
        self.out = out
        self.seconds = 0.0
        self._t0: float | None = None

    def __enter__(self) -> Timer:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0
        if self.out is not None:
            self.out[self.key] = self.out.get(self.key, 0.0) + self.seconds


# ----------------------------------------------------------------------------------------------------------------------
# Eval metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers; the division rounds once


def _is_valid_pred(pred: Any) -> bool:
    return pred is not None and str(pred).strip() != ""


def majority_vote(preds: list[Any], accs: list[bool]) -> tuple[Any, bool]:
    """Majority answer among valid preds and whether it is correct (``(None, False)`` when none is valid).

    Ties go to the answer seen first (sample order); its correctness is that of its first sample.
    """
    if len(preds) != len(accs):
        raise ValueError(f"majority_vote: {len(preds)} preds but {len(accs)} accs")
    valid = [(str(p), a) for p, a in zip(preds, accs) if _is_valid_pred(p)]
    if not valid:
        return None, False
    counts = Counter(p for p, _ in valid)
    best = max(counts.values())
    winner = next(p for p, _ in valid if counts[p] == best)  # first seen among the tied
    return winner, next(a for p, a in valid if p == winner)


def eval_metrics(records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Per data source: ``eval/<source>/avg@k`` (mean accuracy over all samples), ``pass@k`` (fraction of problems
    with at least one correct sample) and ``maj@k`` (fraction whose majority-vote answer is correct).

    Each record: ``data_source``, ``problem_id`` (or ``prompt``), ``pred`` (normalized answer; None/"" = invalid,
    not voted), ``acc`` (bool). ``k`` is the number of samples per problem and must be the same for all problems of
    a source. Records with ``valid`` (the rule found an answer) also give ``format@k``, the share of valid samples.
    """
    groups: dict[str, dict[Any, list[tuple[Any, bool]]]] = {}
    valid: dict[str, list[bool]] = {}
    for i, rec in enumerate(records):
        for key in ("data_source", "acc"):
            if key not in rec:
                raise ValueError(f"eval record {i}: missing key {key!r} (has {sorted(rec)})")
        pid = rec.get("problem_id", rec.get("prompt"))
        if pid is None:
            raise ValueError(f"eval record {i}: needs 'problem_id' or 'prompt' (has {sorted(rec)})")
        acc = rec["acc"]
        if acc not in (0, 1):  # a +-1 reward passed as acc would count -1 as correct
            raise ValueError(f"eval record {i}: acc = {acc!r}: expected a bool (or 0/1)")
        groups.setdefault(str(rec["data_source"]), {}).setdefault(pid, []).append((rec.get("pred"), bool(acc)))
        if "valid" in rec:
            valid.setdefault(str(rec["data_source"]), []).append(bool(rec["valid"]))
    out: dict[str, float] = {}
    for source, problems in groups.items():
        sizes = Counter(len(samples) for samples in problems.values())
        if len(sizes) > 1:
            detail = ", ".join(
                f"{n} samples: {cnt} problems (e.g. {next(p for p, s in problems.items() if len(s) == n)!r})"
                for n, cnt in sorted(sizes.items())
            )
            raise ValueError(f"eval source {source!r}: problems have different numbers of samples ({detail})")
        (k,) = sizes
        accs = [[a for _, a in samples] for samples in problems.values()]
        out[f"eval/{source}/avg@{k}"] = sum(sum(a) for a in accs) / (k * len(accs))
        out[f"eval/{source}/pass@{k}"] = sum(any(a) for a in accs) / len(accs)
        maj = [majority_vote([p for p, _ in s], [a for _, a in s])[1] for s in problems.values()]
        out[f"eval/{source}/maj@{k}"] = sum(maj) / len(maj)
        if valid.get(source):  # share of samples the reward rule found an answer in ("Answer: ...")
            out[f"eval/{source}/format@{k}"] = sum(valid[source]) / len(valid[source])
    return out
