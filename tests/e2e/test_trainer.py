"""End-to-end `dapo train` / `dapo eval` through the real megatron-core actor, HF rollout engine and weight sync."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.helpers import AIME, REPO, make_char_hf_tokenizer, repo_pythonpath, torchrun_cmd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Small and fast: no warm start, no dynamic sampling (an untrained model gets every group wrong), 2 updates per step.
BASE = [
    "train.supervised_warmup_steps=0",
    "algo.dynamic_sampling=false",
    "train.batch_prompts=8",
    "train.mini_batch_prompts=4",
    "algo.gen_batch_prompts=8",
    "algo.group_size=4",
    "data.synthetic_train_size=400",
    "data.synthetic_eval_size=16",
    "eval.interval=0",
    "train.save_interval=1",
    "train.keep_checkpoints=5",
]
KEYS = [
    "step",
    "train/reward_mean",
    "train/acc_mean",
    "train/response_len_mean",
    "train/entropy",
    "train/clip_frac_high",
    "train/clip_frac_low",
    "train/num_gen_batches",
    "train/kept_groups",
    "train/logp_gap_mean",
    "train/ppo_kl",
    "time/step_s",
    "time/rollout_s",
    "time/train_s",
    "time/sync_s",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": repo_pythonpath()}


def dapo(*args, nproc=1, timeout=600, check=True):
    launcher = (
        [*torchrun_cmd(nproc), "-m", "megatron_dapo.cli"] if nproc > 1 else [sys.executable, "-m", "megatron_dapo.cli"]
    )
    proc = subprocess.Popen([*launcher, *args], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        proc.stdout_text, proc.stderr_text = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # what it waits for: every thread's stack (cli.py: SIGUSR2), then stop it
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                if "megatron_dapo.cli" in p.cmdline():  # the trainer's ranks (not torchrun, not the servers)
                    p.send_signal(signal.SIGUSR2)
        time.sleep(3)
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"dapo {args} still running after {timeout} s; its threads' stacks:\n{out[-3000:]}\n{err[-12000:]}")
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout_text, proc.stderr_text)
    if check and proc.returncode != 0:
        pytest.fail(f"dapo {args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def dapo_started(log: Path, *args) -> subprocess.Popen:
    """``dapo ARGS`` in the background, e.g. a reference run beside the run under test (each takes one core: ENV sets
    OMP_NUM_THREADS=1); its output goes to ``log``. Wait for it with ``dapo_finished``."""
    out = open(log, "w")  # noqa: SIM115 (closed by dapo_finished; a pipe could fill and block the run)
    proc = subprocess.Popen([sys.executable, "-m", "megatron_dapo.cli", *args], cwd=REPO, env=ENV, stdout=out,
                            stderr=subprocess.STDOUT)  # fmt: skip
    proc.log = out
    return proc


def dapo_finished(proc: subprocess.Popen, timeout: float = 600) -> None:
    proc.wait(timeout=timeout)
    proc.log.close()
    if proc.returncode != 0:
        pytest.fail(f"dapo {proc.args[3:]} exited {proc.returncode}:\n{Path(proc.log.name).read_text()[-5000:]}")


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_steps_tp2_writes_metrics_checkpoint_and_hf(tmp_path):
    dapo(
        "train",
        "--recipe",
        "demo_cpu",
        *BASE,
        "train.supervised_warmup_steps=1",  # one warm-start step: its held-out eval is logged as step 0
        "train.steps=2",
        "parallel.tp=2",
        f"train.run_dir={tmp_path}",
        "train.name=e2e",
        nproc=2,
    )
    run = tmp_path / "e2e"
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["sft/steps"] == 1 and any(k.startswith("eval/synthetic/add2/avg@") for k in rows[0])
    for key in KEYS:
        assert key in rows[-1], key
    assert any(k.startswith("eval/synthetic/add2/avg@") for k in rows[-1])
    assert rows[-1]["train/kept_groups"] == 8
    assert rows[-1]["train/logp_gap_mean"] < 1e-4  # fp32 HF engine vs megatron actor after a verified sync
    assert (run / "checkpoints" / "step_000002" / "dapo_meta.json").is_file()
    assert (run / "report.png").stat().st_size > 10_000
    # the exported HF checkpoint, run by transformers, computes what the final megatron checkpoint computes
    ref = tmp_path / "actor_lp.pt"
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("actor_logprobs.py")), str(run / "config.yaml"),
                          str(run / "checkpoints" / "step_000002"), str(ref)], cwd=REPO, env=ENV, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert hf_gap(run / "hf", torch.load(ref)) < 1e-4
    assert hf_gap(run / "hf", torch.load(ref), plant="model.layers.1.mlp.down_proj.weight") > 1e-3  # sharp enough


def hf_gap(hf_dir: Path, ref: dict, plant: str | None = None) -> float:
    """Max |logp_transformers - logp_actor| over the reference's response tokens; ``plant`` scales one tensor by 1.01
    first (the kind of error a wrong export would make)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if plant:
        with torch.no_grad():
            model.get_parameter(plant).mul_(1.01)
    gap = 0.0
    with torch.no_grad():
        for tokens, prompt_len, lp in zip(ref["tokens"], ref["prompt_lens"], ref["logprobs"]):
            logits = model(tokens[None]).logits[0, prompt_len - 1 : -1].float()
            mine = logits.log_softmax(-1).gather(-1, tokens[prompt_len:, None])[:, 0]
            gap = max(gap, float((mine - lp).abs().max()))
    return gap


def test_resume_after_sigkill_matches_uninterrupted(tmp_path):
    """SIGKILL after the step-2 checkpoint, then ``--resume auto``: the new process says it resumed from step 2, its
    first step is 3, the metrics lines the killed process wrote for steps 1-2 stay as they were (a rerun from step 0
    would rewrite them: their timings differ) and the resumed process adds exactly step 3, equal to an uninterrupted
    run's. Pruning keeps the newest ``train.keep_checkpoints`` by step number, not by time (step 1 is touched last)."""
    args = ["train", "--recipe", "demo_cpu", *BASE, "train.steps=3", "train.keep_checkpoints=2",
            f"train.run_dir={tmp_path}"]  # fmt: skip
    reference = dapo_started(tmp_path / "straight.log", *args, "train.name=straight")

    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "megatron_dapo.cli", *args, "train.name=killed"]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    marker = run / "checkpoints" / "step_000002" / "dapo_meta.json"
    deadline = time.time() + 500
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), "the run never wrote its step-2 checkpoint"
    before = [line for line in (run / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 2]
    assert [json.loads(line)["step"] for line in before] == [1, 2]
    newest = time.time() + 5
    os.utime(run / "checkpoints" / "step_000001", (newest, newest))  # the oldest step, the newest mtime
    out = dapo(*args, "train.name=killed", "--resume", "auto").stdout
    dapo_finished(reference)

    assert f"resuming from {run / 'checkpoints' / 'step_000002'} (step 2)" in out, out[-2000:]
    printed = [json.loads(line)["step"] for line in out.splitlines() if line.startswith('{"step"')]
    assert printed == [3], f"the resumed process ran steps {printed}"
    assert re.search(r"DAPO steps .* 100%", out), out[-2000:]  # the bar ends full (it stopped one short before)
    after = (run / "metrics.jsonl").read_text().splitlines()
    assert after[: len(before)] == before, "the resumed run rewrote the killed run's metrics"
    assert [json.loads(line)["step"] for line in after[len(before) :]] == [3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    straight = metrics(tmp_path / "straight")
    resumed = {r["step"]: r for r in metrics(run)}
    assert sorted(resumed) == [1, 2, 3]
    for key, value in straight[2].items():
        if key.startswith(("train/", "eval/")) and not key.startswith("train/skipped"):
            assert resumed[3][key] == value, key


def test_eval_tiny_model_on_aime(tmp_path):
    tok = make_char_hf_tokenizer(tmp_path / "tok")
    arch = tmp_path / "tiny-ascii.yaml"
    arch.write_text(
        (REPO / "model_configs" / "tiny.yaml")
        .read_text()
        .replace("vocab_size: 32", "vocab_size: 128")
        .replace("max_position_embeddings: 512", "max_position_embeddings: 4096")
    )
    common = [
        f"model.arch={arch}",
        f"model.tokenizer={tok}",
        "data.max_prompt_len=2048",
        "rollout.sampling.max_new_tokens=4",
        "parallel.max_tokens_per_micro_batch=4096",
        "eval.greedy=false",
    ]
    # a randomly initialised checkpoint of the tiny architecture
    ckpt = tmp_path / "ckpt"
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tests.e2e.save_init import main; main(sys.argv[1:])",
            str(ckpt),
            *common,
        ],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    dump = tmp_path / "samples.jsonl"
    proc = dapo("eval", "--load", str(ckpt), "--data", str(AIME), "--n", "32", "--samples-out", str(dump), *common)
    lines = {k: float(v) for k, v in (line.split() for line in proc.stdout.splitlines() if line.startswith("eval/"))}
    assert lines["eval/aime-2024/problems"] == 30 and lines["eval/aime-2024/samples"] == 30 * 32
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    check_eval_dump(rows, lines, AIME, k=32)
    # planted faults the check must see: answers scored against the next problem's ground truth; a miscounted avg
    shifted = [dict(r, ground_truth=rows[(i + 32) % len(rows)]["ground_truth"]) for i, r in enumerate(rows)]
    with pytest.raises(AssertionError):
        check_eval_dump(shifted, lines, AIME, k=32)
    with pytest.raises(AssertionError):
        check_eval_dump(rows, {**lines, "eval/aime-2024/avg@32": lines["eval/aime-2024/avg@32"] + 1 / 960}, AIME, 32)


def check_eval_dump(rows: list[dict], printed: dict, parquet: Path, k: int) -> None:
    """The printed metrics, recomputed from the dumped samples and the parquet file read independently."""
    import pyarrow.parquet as pq

    from megatron_dapo.reward.math_dapo import compute_score

    truth = {}  # prompt text -> ground truth, from the file itself
    for r in pq.read_table(parquet).to_pylist():
        truth.setdefault(r["prompt"][-1]["content"], r["reward_model"]["ground_truth"])
    by_problem = {}
    for r in rows:
        by_problem.setdefault(r["problem_id"], []).append(r)
        content = next(c for c in truth if c in r["prompt"])  # the rendered prompt holds the problem's text
        assert r["ground_truth"] == truth[content], r["problem"]  # scored against this problem's answer
        rescored = compute_score(r["response"], r["ground_truth"])
        assert (rescored["score"], bool(rescored["acc"])) == (r["score"], r["acc"]), r
    assert len(by_problem) == len(truth) and all(len(v) == k for v in by_problem.values())
    assert all(sorted(x["sample"] for x in v) == list(range(k)) for v in by_problem.values())
    assert len({x["response"] for x in rows}) > len(rows) // 2  # k samples at T = 1, not k copies of one
    avg = sum(r["acc"] for r in rows) / len(rows)
    pass_k = sum(any(x["acc"] for x in v) for v in by_problem.values()) / len(by_problem)
    assert printed[f"eval/aime-2024/avg@{k}"] == pytest.approx(avg, abs=1e-4)
    assert printed[f"eval/aime-2024/pass@{k}"] == pytest.approx(pass_k, abs=1e-4)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["algo.eps_hihg=0.3"], "algo.eps_hihg"),
        (["data.synthetic=none", "data.train_files=[/nonexistent/train.parquet]"], "/nonexistent/train.parquet"),
    ],
)
def test_bad_input_fails_before_compute(tmp_path, args, needle):
    proc = dapo("train", "--recipe", "demo_cpu", *args, f"train.run_dir={tmp_path}", timeout=120, check=False)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert not (tmp_path / "demo_cpu" / "checkpoints").exists()


def test_row_without_ground_truth_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "synthetic/add2",
            "prompt": [{"role": "user", "content": f"0{i}+11="}],
            "reward_model": {"style": "rule", "ground_truth": str(i + 11) if i != 3 else ""},
        }
        for i in range(6)
    ]
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    proc = dapo(
        "train",
        "--recipe",
        "demo_cpu",
        "data.synthetic=none",
        f"data.train_files=[{path}]",
        f"train.run_dir={tmp_path}",
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "bad.parquet" in proc.stderr and "row 3" in proc.stderr and "ground_truth" in proc.stderr


def test_help_is_complete():
    out = dapo("--help").stdout
    for command in ("train", "eval", "report", "convert", "plan", "launch"):
        assert command in out
