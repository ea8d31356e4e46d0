"""Issue 22 #6: slurm/common.sh's PYTHON defaults to the repository's .venv, a CPU-torch environment: the GPU scripts
(they ask for CUDA devices and SGLang) refuse such a PYTHON before any step, naming the fix. Runs the real scripts
with bash (no Slurm needed): this CPU venv as PYTHON, and a stand-in python that reports a CUDA build."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tests.slurm.test_sbatch_inputs import make_inputs

pytestmark = pytest.mark.timeout(120)
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CONTAINER_", "PYTHON"))}


@pytest.fixture(autouse=True)
def inputs(tmp_path, monkeypatch):
    """The scripts check their paths before the python: valid ones (test_sbatch_inputs.py tests that check)."""
    for key, value in make_inputs(tmp_path / "inputs").items():
        monkeypatch.setitem(ENV, key, value)


def _run(script: str, *args: str, python: str = sys.executable, **env: str) -> subprocess.CompletedProcess:
    env = {**ENV, "DAPO_ROOT": str(REPO), "PYTHON": python, **env}
    return subprocess.run(["bash", f"slurm/{script}", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=100)  # fmt: skip


@pytest.mark.parametrize("script", ["dapo_32b.sbatch", "dapo_7b.sbatch"])
def test_gpu_scripts_refuse_a_cpu_torch_before_any_step(script):
    out = _run(script)  # this interpreter: the project's CPU venv
    assert out.returncode == 3, out.stderr
    assert f"this job needs CUDA devices and SGLang, but PYTHON={sys.executable} has a CPU-only torch" in out.stderr
    assert "set PYTHON=/path/to/gpu-venv/bin/python" in out.stderr and "CONTAINER_IMAGE=" in out.stderr
    assert "FAILED in phase check python" in out.stderr and "== launch" not in out.stderr


def test_a_cuda_torch_a_container_or_a_dry_run_passes_the_check(tmp_path):
    fake = tmp_path / "python"  # a CUDA build: answers the check, then stands in for the driver
    fake.write_text('#!/bin/sh\ncase "$*" in *torch.version.cuda*) echo 12.8;; *) echo "driver $*";; esac\n')
    fake.chmod(0o755)
    out = _run("dapo_32b.sbatch", python=str(fake))
    assert out.returncode == 0 and "driver -m megatron_dapo.launch.slurm" in out.stdout, out.stderr
    # a container: the steps run the image's python (checked in the image by the driver); the driver this one, on the
    # host, where a CPU torch does (test_sbatch_inputs.py); --dry-run starts nothing
    image = {"CONTAINER_IMAGE": "nvcr.io#nvidia/pytorch:25.04-py3", "CONTAINER_MOUNTS": f"{tmp_path}:{tmp_path}"}
    for python, how, args in ((sys.executable, image, ()), (str(tmp_path / "none"), {}, ("--dry-run",))):
        out = _run("dapo_32b.sbatch", *args, python=python, **how)
        assert "CPU-only torch" not in out.stderr and "cannot import torch" not in out.stderr, out.stderr
        assert "== launch" in out.stderr


def test_a_python_without_torch_is_refused(tmp_path):
    out = _run("dapo_7b.sbatch", python="/usr/bin/false")
    assert out.returncode == 3 and "PYTHON=/usr/bin/false cannot import torch" in out.stderr, out.stderr
