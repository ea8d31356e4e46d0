"""A requeued job whose checkpoint is already at the last step still writes the HF export: the first attempt ends
without one (``train.export_hf=false`` stands in for a job killed during its export), the resumed run trains no step
and exports the final weights, equal to the final checkpoint converted offline."""

import pytest
import torch

from tests.e2e.test_trainer import dapo

pytestmark = [pytest.mark.timeout(300)]

TINY = ["train.supervised_warmup_steps=0", "algo.dynamic_sampling=false", "train.batch_prompts=2",
        "train.mini_batch_prompts=2", "algo.gen_batch_prompts=2", "algo.group_size=2", "data.synthetic_train_size=16",
        "data.synthetic_eval_size=4", "eval.interval=0", "eval.at_start=false", "train.steps=1"]  # fmt: skip


def test_resume_at_the_last_step_still_exports(tmp_path):
    from safetensors.torch import load_file

    from megatron_dapo.bridge.convert_to_hf import megatron_to_hf

    args = ["train", "--recipe", "demo_cpu", *TINY, f"train.run_dir={tmp_path}", "train.name=r"]
    dapo(*args, "train.export_hf=false", timeout=120)
    run = tmp_path / "r"
    assert (run / "checkpoints" / "step_000001").is_dir() and not (run / "hf").exists()
    out = dapo(*args, "--resume", "auto", timeout=120).stdout
    assert "resuming from" in out and "(step 1)" in out
    assert (run / "hf" / "config.json").is_file()
    megatron_to_hf(run / "checkpoints" / "step_000001", tmp_path / "ref")
    got, want = load_file(run / "hf" / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
