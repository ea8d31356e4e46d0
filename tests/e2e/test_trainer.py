"""End-to-end `dapo train` / `dapo eval` through the real megatron-core actor, HF rollout engine and weight sync."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import AIME, REPO, make_char_hf_tokenizer, torchrun_cmd

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
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def dapo(*args, nproc=1, timeout=600, check=True):
    launcher = (
        [*torchrun_cmd(nproc), "-m", "megatron_dapo.cli"] if nproc > 1 else [sys.executable, "-m", "megatron_dapo.cli"]
    )
    proc = subprocess.run([*launcher, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"dapo {args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


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
    # the exported HF checkpoint loads in transformers as is
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "hf")
    assert model.config.num_hidden_layers == 2


def test_resume_after_sigkill_matches_uninterrupted(tmp_path):
    args = ["train", "--recipe", "demo_cpu", *BASE, "train.steps=3", f"train.run_dir={tmp_path}"]
    dapo(*args, "train.name=straight")
    straight = metrics(tmp_path / "straight")

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
    dapo(*args, "train.name=killed", "--resume", "auto")
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
    proc = dapo("eval", "--load", str(ckpt), "--data", str(AIME), "--n", "32", *common)
    lines = dict(line.split() for line in proc.stdout.splitlines() if line.startswith("eval/"))
    assert float(lines["eval/aime-2024/problems"]) == 30
    assert float(lines["eval/aime-2024/samples"]) == 30 * 32
    assert 0.0 <= float(lines["eval/aime-2024/avg@32"]) <= float(lines["eval/aime-2024/pass@32"]) <= 1.0


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
