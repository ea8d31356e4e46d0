"""Reward workers contain what a reward function does wrong (issue 49, part 5): a leaking function's worker is
recycled at its memory limit and after reward.worker_max_tasks calls; the processes a call starts die with it (on a
hard timeout too); a call that kills its worker (os._exit) or calls sys.exit() fails only its own sample; numpy scalars
and bools are scores; a module that exits or raises at import is a ConfigError naming reward.fn and its file."""

from __future__ import annotations

import textwrap
import time

import pytest

from megatron_dapo.config.run_config import RewardConfig, load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.reward.registry import RewardScorer

pytestmark = pytest.mark.timeout(120)

FUNCTIONS = textwrap.dedent(
    """
    import math, os, signal, subprocess, sys, time
    import numpy as np
    import psutil

    _HELD = []

    def leaks(prompt, response, ground_truth, metadata):
        _HELD.append(b"x" * (40 * 2**20))  # 40 MB per call, written, so resident
        return psutil.Process().memory_info().rss / 2**20

    def pid(prompt, response, ground_truth, metadata):
        return float(os.getpid())

    def _daemon(pid_file):
        if os.fork() == 0:  # child: start a daemon (double fork, new session) and leave
            os.setsid()
            if os.fork() == 0:
                with open(pid_file, "a") as f:
                    f.write(f"{os.getpid()}\\n")
                time.sleep(300)
            os._exit(0)

    def forks(prompt, response, ground_truth, metadata):
        child = subprocess.Popen(["sleep", "300"])
        with open(ground_truth, "a") as f:
            f.write(f"{child.pid}\\n")
        _daemon(ground_truth)
        deadline = time.monotonic() + 10
        while len(open(ground_truth).read().split()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        if response == "hang":  # past the soft limit too: the pool must kill the worker and its processes
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(300)
        return 1.0

    def forks_then_crashes(prompt, response, ground_truth, metadata):
        child = subprocess.Popen(["sleep", "300"])
        with open(ground_truth, "a") as f:
            f.write(f"{child.pid}\\n")
        os._exit(1)

    def crashes(prompt, response, ground_truth, metadata):
        if response == "crash":
            time.sleep(0.1)
            os._exit(1)
        if response == "exit":
            sys.exit(3)
        time.sleep(0.5)  # still running when its neighbour crashes
        return float(os.getpid())

    def numpy_scores(prompt, response, ground_truth, metadata):
        return {
            "f32": np.float32(0.5), "i64": np.int64(2), "np_true": np.bool_(True), "true": True, "false": False,
            "dict": {"score": np.float64(1.0), "acc": np.bool_(False), "passed": True, "n": np.int32(3)},
            "zero_d": np.array(0.25),
            "nan": np.float32("nan"), "inf": math.inf, "text": "1.0",
        }[response]
    """
)


@pytest.fixture
def fns(tmp_path):
    path = tmp_path / "contained.py"
    path.write_text(FUNCTIONS)
    return path


def scorer(fns, name: str, **kw) -> RewardScorer:
    return RewardScorer.from_config(RewardConfig(fn=f"{fns}:{name}", **kw))


def rows(n: int, truth: str = "1") -> list[dict]:
    return [{"prompt": "q", "data_source": "mine", "reward_model": {"ground_truth": truth}} for _ in range(n)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"  # a zombie is dead for our purposes
    except FileNotFoundError:
        return False


def _gone(pids: list[int], within_s: float = 5.0) -> list[int]:
    """The pids still alive after ``within_s`` (a killed process may take a moment to be reaped)."""
    deadline = time.monotonic() + within_s
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_a_leaking_function_s_worker_is_recycled_when_its_memory_passes_the_limit(fns):
    """Found: 536 -> 2,036 MB over 20 calls of a leaking function; workers were never recycled."""
    with scorer(fns, "leaks", workers=1, worker_max_rss_mb=300) as s:
        rss = [r["score"] for r in s.score_batch(["x"] * 16, rows(16))]
        assert max(rss) < 300 + 40 + 20, rss  # the limit, plus at most the one call that passed it
        assert s.user_fn.pool.counters["recycled"] >= 2, (rss, s.user_fn.pool.counters)
        assert all(r > 0 for r in rss)  # every call scored: recycling costs no sample


def test_a_worker_is_recycled_after_worker_max_tasks_calls(fns):
    with scorer(fns, "pid", workers=1, worker_max_tasks=3) as s:
        pids = [int(r["score"]) for r in s.score_batch(["x"] * 7, rows(7))]
        assert [len(set(pids[i : i + 3])) for i in (0, 3, 6)] == [1, 1, 1], pids
        assert len(set(pids)) == 3 and s.user_fn.pool.counters["recycled"] == 2, pids


def test_the_processes_a_call_starts_are_killed_when_it_ends(fns, tmp_path):
    """Found: subprocesses a reward function starts outlived it (a daemonized one too)."""
    pid_files = [tmp_path / f"pids{i}" for i in range(2)]
    with scorer(fns, "forks", workers=2, timeout_s=1.0) as s:
        out = s.score_batch(["a", "b"], [rows(1, str(f))[0] for f in pid_files])
        assert [r["status"] for r in out] == ["ok", "ok"]
        started = [int(p) for f in pid_files for p in f.read_text().split()]
        assert len(started) == 4, started  # a subprocess and a daemon per call
        assert not _gone(started), "the calls' processes outlived them"
        assert s.user_fn.pool.counters["children_killed"] >= 4
        workers = s.user_fn.pool.worker_pids()
        assert all(_alive(w) for w in workers)  # the workers themselves go on


def test_a_hard_timeout_kills_the_worker_s_processes_with_it(fns, tmp_path):
    pid_file = tmp_path / "pids"
    with scorer(fns, "forks", workers=1, timeout_s=1.0) as s:
        s.user_fn.pool.grace_s = 1.0
        out = s.score_batch(["hang"], rows(1, str(pid_file)))
        assert out[0]["status"] == "timeout"
        started = [int(p) for p in pid_file.read_text().split()]
        assert len(started) == 2 and not _gone(started), started


def test_a_call_that_kills_its_worker_takes_its_processes_with_it(fns, tmp_path):
    pid_file = tmp_path / "pids"
    with scorer(fns, "forks_then_crashes", workers=1) as s:
        assert s.score("x", rows(1, str(pid_file))[0])["status"] == "error"
        started = [int(p) for p in pid_file.read_text().split()]
        assert len(started) == 2 and not _gone(started), started  # one per try


def test_a_crashing_sample_costs_only_itself(fns):
    """Found: os._exit in one sample failed the innocent sample running beside it."""
    with scorer(fns, "crashes", workers=2, timeout_s=10.0) as s:
        out = s.score_batch(["a", "crash", "b", "c", "d"], rows(5))
        assert [r["status"] for r in out] == ["ok", "error", "ok", "ok", "ok"], out
        assert "worker process died (exit code 1)" in out[1]["pred"]
        assert s.user_fn.pool.counters["restarts"] == 2  # the crashing call ran twice, in fresh workers
        assert s.metrics()["reward/errors"] == 1


def test_sys_exit_in_a_call_fails_that_sample_not_the_trainer(fns):
    with scorer(fns, "crashes", workers=1) as s:
        out = s.score_batch(["a", "exit", "b"], rows(3))
        assert [r["status"] for r in out] == ["ok", "error", "ok"]
        assert "sys.exit(3)" in out[1]["pred"] and out[0]["score"] == out[2]["score"]  # the same worker went on


@pytest.mark.parametrize(
    ("response", "score", "acc"),
    [
        ("f32", 0.5, True),
        ("i64", 2.0, True),
        ("np_true", 1.0, True),
        ("true", 1.0, True),
        ("false", 0.0, False),
        ("dict", 1.0, False),
        ("zero_d", 0.25, True),
    ],
)
def test_numpy_scalars_and_bools_are_scores(fns, response, score, acc):
    """Found: numpy scalars and bools were refused (every sample -1, the run stopped after 64 failures)."""
    s = scorer(fns, "numpy_scores", workers=0)
    out = s.score(response, rows(1)[0])
    assert (out["status"] in ("ok", "wrong"), out["score"], out["acc"]) == (True, score, acc), out
    assert type(out["score"]) is float
    if response == "dict":
        m = s.metrics()
        assert (m["reward/passed"], m["reward/n"]) == (1.0, 3.0)


@pytest.mark.parametrize(
    ("response", "needle"),
    [
        ("nan", "score = nan: must be a finite number"),
        ("inf", "score = inf: must be a finite number"),
        ("text", "score = '1.0' (str): must be a finite number or a bool"),
    ],
)
def test_nan_inf_and_strings_are_still_refused_naming_the_value(fns, response, needle):
    out = scorer(fns, "numpy_scores", workers=0).score(response, rows(1)[0])
    assert out["status"] == "error" and needle in out["pred"], out


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("import sys\nsys.exit('config missing')\n", "called sys.exit('config missing')"),
        ("import sys\n\nsys.exit()\n", "called sys.exit(None)"),
        ("x = 1\nraise RuntimeError('no GPU here')\n", "raised RuntimeError: no GPU here"),
    ],
)
def test_an_import_that_exits_or_raises_names_reward_fn_and_the_file(tmp_path, monkeypatch, body, needle):
    """Found: sys.exit() at import printed "config missing" without naming the key."""
    path = tmp_path / "exits_at_import.py"
    path.write_text(body + "def score(**kw):\n    return 1.0\n")
    line = body.count("\n")
    for spec in (f"{path}:score", "exits_at_import:score"):  # by its file, and as a module on the path
        monkeypatch.syspath_prepend(str(tmp_path))
        with pytest.raises(ConfigError) as e:
            RewardScorer.from_config(RewardConfig(fn=spec))
        msg = str(e.value)
        assert f"reward.fn = {spec!r}" in msg and f"{path}, line {line}" in msg and needle in msg, msg


def test_the_worker_limits_are_settings_for_reward_fn_and_math_verify_alike():
    with pytest.raises(ConfigError, match=r"reward.worker_max_tasks = -1: must be >= 0"):
        load_config("demo_cpu", ["reward.worker_max_tasks=-1"])
    with pytest.raises(ConfigError, match=r"reward.worker_max_rss_mb = -5: must be >= 0"):
        load_config("demo_cpu", ["reward.fn=m:f", "reward.worker_max_rss_mb=-5"])
    cfg = load_config("demo_cpu", ["reward.worker_max_tasks=7", "reward.worker_max_rss_mb=512"]).reward
    assert (cfg.worker_max_tasks, cfg.worker_max_rss_mb) == (7, 512)  # not "ignored" without reward.fn
    mv = RewardScorer.from_config(cfg).math_verify
    assert (mv.max_tasks, mv.max_rss_mb) == (7, 512)
    defaults = RewardConfig()
    assert (defaults.worker_max_tasks, defaults.worker_max_rss_mb) == (1000, 2048)
