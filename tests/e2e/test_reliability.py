"""Faults of a long run through the real `dapo train` (docs/reliability.md): a stop request saves and resumes exactly,
bad input fails before compute with one line naming the culprit, run-time failures print one line from rank 0 only,
a full disk keeps the previous checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_trainer import BASE, ENV, dapo, dapo_finished, dapo_started, metrics
from tests.helpers import REPO, skip_unless_required, torchrun_cmd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# keys that depend on the run's history (not on wall time): equal between an interrupted and an uninterrupted run
HISTORY = ("train/", "eval/", "perf/packing")


def same_history(a: dict, b: dict) -> list[str]:
    return [k for k in a if k.startswith(HISTORY) and not k.startswith("train/skipped") and a[k] != b.get(k)]


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        path = run / "metrics.jsonl"
        if path.exists() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines()[:-1]):
            return
        time.sleep(0.05)
    raise AssertionError(f"the run never logged step {step} (exit code {proc.poll()})")


# LoRA: random adapters (they differ from the base from step 1) that train (overlong shaping varies the rewards), on a
# base read from an HF checkpoint, so that checkpoints hold the adapters alone (model.lora.checkpoint = adapters)
LORA = ["model.lora.rank=8", "model.lora.init=random", "train.lr=1e-2", "algo.overlong_penalty=true",
        "algo.overlong_cache=10", "rollout.sampling.max_new_tokens=12", "model.tokenizer=char"]  # fmt: skip


def tiny_hf_base(directory: Path, seed: int) -> Path:
    """A randomly initialized HF checkpoint of the demo's architecture (what a LoRA run adapts)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from megatron_dapo.models.arch import load_arch
    from megatron_dapo.models.hf_config import transformers_config

    torch.manual_seed(seed)
    Qwen2ForCausalLM(transformers_config(load_arch("tiny"))).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sigusr1_saves_then_resume_equals_uninterrupted_run(tmp_path, lora):
    """SIGUSR1 (what the sbatch scripts turn the time-limit signal into) mid-run: the trainer finishes the step, saves,
    exits 0; `--resume auto` continues; metrics.jsonl then holds each step once, equal to an uninterrupted run's
    (with LoRA: checkpoints hold the adapters and their optimizer states alone, and resume them exactly on the base;
    a resume on another base is refused)."""
    extra = [*LORA, f"model.hf_init={tiny_hf_base(tmp_path / 'base', 0)}"] if lora else []
    args = ["train", "--recipe", "demo_cpu", *BASE, "train.save_interval=0", "train.steps=8", "eval.interval=3",
            f"train.run_dir={tmp_path}", *extra]  # fmt: skip
    reference = dapo_started(tmp_path / "straight.log", *args, "train.name=straight")

    run = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "megatron_dapo.cli", *args, "train.name=stopped"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(run, 1, proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    first = metrics(run)
    stopped_at = first[-1]["step"]
    assert 1 <= stopped_at < 8, f"the run ended at step {stopped_at}: the signal came too late to test a stop"
    assert f"stopped after step {stopped_at} of 8 (SIGUSR1); saved {run}/checkpoints/step_{stopped_at:06d}" in out
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step_{stopped_at:06d}"]  # save_interval=0
    assert not (run / "hf").exists()  # the final export waits for the real end
    if lora:
        saved = run / "checkpoints" / f"step_{stopped_at:06d}"
        meta = json.loads((saved / "dapo_meta.json").read_text())
        assert meta["weights"] == "adapters" and meta["base"] == {"hf_init": str((tmp_path / "base").resolve())}, meta
        assert meta["lora"] == {
            "rank": 8,
            "alpha": 32.0,
            "dropout": 0.0,
            "targets": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        }
        # the adapters and their Adam moments, no base weight (the 2 layers' adapters at rank 8: 39k parameters)
        from torch.distributed.checkpoint import FileSystemReader

        keys = list(FileSystemReader(str(saved)).read_metadata().state_dict_metadata)
        weights = [k for k in keys if any(part in k for part in ("embedding.", "decoder.", "output_layer."))]
        assert weights and all(".lora_" in k for k in weights), [k for k in weights if ".lora_" not in k][:5]
        base_bytes = (tmp_path / "base" / "model.safetensors").stat().st_size
        assert sum(f.stat().st_size for f in saved.rglob("*.distcp")) < 0.4 * base_bytes

    resumed = dapo(*args, "train.name=stopped")  # --resume auto is the default
    dapo_finished(reference)
    straight = {r["step"]: r for r in metrics(tmp_path / "straight")}
    assert f"resuming from {run}/checkpoints/step_{stopped_at:06d} (step {stopped_at})" in resumed.stdout
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 9))  # appended, each step once
    assert rows[:stopped_at] == first  # the first allocation's lines are kept as they were
    for r in rows:
        assert not same_history(straight[r["step"]], r), (r["step"], same_history(straight[r["step"]], r))
    assert any(k.startswith("eval/") for k in rows[5]) and (run / "hf" / "config.json").is_file()
    if lora:
        assert all(r["train/grad_norm"] > 0 for r in rows[1:])  # the adapters train: resuming them is tested
        tiny_hf_base(tmp_path / "base", 1)  # another base where the run's was: its adapters do not fit it
        refused = dapo(*args, "train.name=stopped", "train.steps=9", check=False)
        assert refused.returncode != 0
        assert "holds LoRA adapters trained on the base" in refused.stderr and "differs" in refused.stderr, (
            refused.stderr[-2000:]
        )


def test_sigusr1_under_torchrun_saves_on_every_rank_and_resumes(tmp_path):
    """The time-limit signal under torchrun, 2 ranks (TP 2): SIGUSR1 to every rank (what `srun --signal`/`scancel
    --signal=USR1` send; torchrun itself would die of it) -> each survives, rank 0's request is agreed by all, both
    save the step, torchrun exits 0; `--resume auto` on 2 ranks continues from that step to the end."""
    import psutil

    args = ["train", "--recipe", "demo_cpu", *BASE, "parallel.tp=2", "train.save_interval=0", "train.steps=6",
            "eval.interval=0", "train.export_hf=false", f"train.run_dir={tmp_path}", "train.name=tr"]  # fmt: skip
    run = tmp_path / "tr"
    cmd = [*torchrun_cmd(2), "-m", "megatron_dapo.cli", *args]
    with open(tmp_path / "out.log", "w") as out_f, open(tmp_path / "err.log", "w") as err_f:  # files: no pipe to fill
        proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=out_f, stderr=err_f, start_new_session=True)
        try:
            wait_for_step(run, 1, proc)
            ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "megatron_dapo.cli" in p.cmdline()]
            assert len(ranks) == 2, ranks
            for p in ranks:
                p.send_signal(signal.SIGUSR1)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    out, err = (tmp_path / "out.log").read_text(), (tmp_path / "err.log").read_text()
    assert proc.returncode == 0, err[-3000:]
    stopped_at = metrics(run)[-1]["step"]
    assert 1 <= stopped_at < 6, f"the run ended at step {stopped_at}: the signal came too late to test a stop"
    assert f"stopped after step {stopped_at} of 6 (SIGUSR1); saved {run}/checkpoints/step_{stopped_at:06d}" in out
    ckpt = run / "checkpoints" / f"step_{stopped_at:06d}"
    assert (ckpt / "dapo_meta.json").is_file()
    resumed = dapo(*args, nproc=2)
    assert f"resuming from {ckpt} (step {stopped_at})" in resumed.stdout
    assert [r["step"] for r in metrics(run)] == list(range(1, 7))


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """A finished 1-step run (its folder, its arguments), shared by the refusals below: none of them may change it."""
    run_dir = tmp_path_factory.mktemp("one_step")
    args = ["train", "--recipe", "demo_cpu", *BASE, "train.steps=1", f"train.run_dir={run_dir}", "train.name=r"]
    dapo(*args)
    return run_dir, args


def test_fresh_start_over_an_existing_run_is_refused(one_step_run):
    run_dir, args = one_step_run
    before = (run_dir / "r" / "metrics.jsonl").read_text()
    proc = dapo(*args, "--resume", "none", check=False)
    assert proc.returncode == 2
    assert f"error: --resume none: {run_dir}/r/checkpoints already holds checkpoints of run 'r' (up to step 1)" in (
        proc.stderr
    )
    assert (run_dir / "r" / "metrics.jsonl").read_text() == before  # not truncated, not moved aside


def _arch(tmp_path: Path, name: str, **changes) -> Path:
    text = (REPO / "model_configs" / "tiny.yaml").read_text()
    for key, (old, new) in changes.items():
        text = text.replace(f"{key}: {old}", f"{key}: {new}")
    path = tmp_path / f"{name}.yaml"
    path.write_text(text.replace("name: tiny", f"name: {name}"))
    return path


def _only_error_line(stderr: str) -> str:
    """The one ``error:`` line, and no traceback through our code on any rank (torchrun's own report may follow)."""
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr[-4000:]
    frames = [line for line in stderr.splitlines() if line.strip().startswith("File ") and "megatron_dapo" in line]
    assert not frames, stderr[-4000:]
    return lines[0]


def test_bad_input_is_named_before_compute(tmp_path):
    """A new user's mistakes, each one line naming the culprit, exit 2, no checkpoint written."""
    run = ["train", "--recipe", "demo_cpu", *BASE, "train.steps=1", f"train.run_dir={tmp_path}"]
    # an override the run would not use (demo_cpu makes its own prompts)
    proc = dapo(*run, "data.train_files=[/data/dapo-math-17k.parquet]", check=False)
    assert proc.returncode == 2 and "data.train_files = ['/data/dapo-math-17k.parquet'] would be ignored" in (
        _only_error_line(proc.stderr)
    )
    # an HF checkpoint of another architecture (its config.json is read before the model is built)
    hf = tmp_path / "llama-hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
        "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}))  # fmt: skip
    proc = dapo(*run, f"model.hf_init={hf}", f"model.tokenizer={hf}", check=False)
    line = _only_error_line(proc.stderr)
    assert proc.returncode == 2 and f"model.hf_init = {hf}: config.json vs model.arch = tiny: family mismatch" in line
    # TP that does not divide the model (tiny has 2 KV groups), under torchrun: one line from rank 0
    tp3 = _arch(tmp_path, "tiny-3kv", num_attention_heads=(4, 6), num_query_groups=(2, 3), hidden_size=(128, 132))
    cmd = [*torchrun_cmd(2), "-m", "megatron_dapo.cli", *run, "parallel.tp=2", f"model.arch={tp3}"]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert _only_error_line(proc.stderr) == "error: parallel.tp = 2: must divide the KV groups of tiny-3kv (3)"
    assert not list(tmp_path.rglob("dapo_meta.json"))


def test_resume_checkpoint_of_another_model_is_named(one_step_run, tmp_path):
    run_dir, args = one_step_run
    ckpt = run_dir / "r" / "checkpoints" / "step_000001"
    wider = _arch(tmp_path, "tiny-wide", ffn_hidden_size=(512, 768))
    proc = dapo(*args[:-1], "train.name=b", f"model.arch={wider}", "--resume", str(ckpt), check=False)
    assert proc.returncode == 2
    assert _only_error_line(proc.stderr) == (
        f"error: {ckpt} (architecture tiny) vs model.arch = tiny-wide: ffn_hidden_size mismatch: model config has "
        "768, checkpoint has 512"
    )


def test_dynamic_sampling_error_is_one_line_from_rank0(tmp_path):
    """An untrained model gets every group wrong: with one generation batch allowed, dynamic sampling must fail.
    Two ranks: rank 0 fails in the rollout, rank 1 is told (no hang, no traceback), one line, exit code 1."""
    cmd = [*torchrun_cmd(2), "-m", "megatron_dapo.cli", "train", "--recipe", "demo_cpu",
           *[a for a in BASE if not a.startswith("algo.dynamic_sampling")], "algo.max_gen_batches=1", "parallel.tp=2",
           "train.steps=2", f"train.run_dir={tmp_path}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    line = _only_error_line(proc.stderr)
    assert line.startswith("error: ") and "algo.max_gen_batches" in line and "DriverError" not in line, line
    assert "exitcode  : 1" in proc.stderr  # torchrun's summary: our ranks exited 1 (not a crash or a timeout)


def test_full_disk_keeps_previous_checkpoint(tmp_path):
    """The run directory on a 12 MiB tmpfs: the first checkpoint (6 MiB) fits, the second does not. Without root or
    mount it skips, unless DAPO_REQUIRE_MOUNT=1 (`make test`): then it fails."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        skip_unless_required("mount", "mounting a size-limited tmpfs needs root and mount(8)")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12M", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        skip_unless_required("mount", f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        proc = dapo("train", "--recipe", "demo_cpu", *BASE, "train.save_interval=1", "train.keep_checkpoints=1",
                    "train.steps=3", f"train.run_dir={disk}", "train.name=full", check=False)  # fmt: skip
        ckpts = disk / "full" / "checkpoints"
        assert proc.returncode == 1, proc.stderr[-3000:]
        line = _only_error_line(proc.stderr)
        assert line.startswith(f"error: checkpoint {ckpts}/step_000002 was not written (") and " MiB free " in line
        assert line.endswith(f"the previous checkpoint {ckpts}/step_000001 is kept"), line
        assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001"]
        assert (ckpts / "step_000001" / "dapo_meta.json").is_file()
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
