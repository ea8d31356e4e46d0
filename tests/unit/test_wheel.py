"""A wheel built from the repository carries the architectures (model_configs/, as megatron_dapo/model_configs) and
the recipes; installed without the checkout (not editable, run from elsewhere), `dapo plan` and `dapo convert`
work from the installed package alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.timeout(600)


def test_the_wheel_carries_model_configs_and_recipes_and_runs_without_the_checkout(tmp_path):
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ and egg-info behind
    src.mkdir()
    for name in [
        n for n in ("pyproject.toml", "setup.py", "README.md", "megatron_dapo", "model_configs") if (REPO / n).exists()
    ]:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy2
        copy(
            REPO / name,
            src / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}),
        )
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("megatron_dapo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {p.name for p in (REPO / "model_configs").glob("*.yaml")}
    recipes = {p.name for p in (REPO / "megatron_dapo" / "recipes").glob("*.yaml")}
    assert {f"megatron_dapo/model_configs/{n}" for n in configs} <= names
    assert {f"megatron_dapo/recipes/{n}" for n in recipes} <= names and "qwen3-32b.yaml" in configs

    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of the checkout's editable install

    def dapo(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "megatron_dapo.cli", *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    where = subprocess.run([sys.executable, "-c", "import megatron_dapo.config.run_config as c; print(c.__file__, "
                            "c.MODEL_CONFIGS_DIR, c.RECIPES_DIR)"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, check=True).stdout.split()  # fmt: skip
    assert all(path.startswith(str(site)) for path in where), where
    plan = dapo("plan", "--model", "qwen3-32b", "--max-prompt", "2048", "--max-response", "20480", "--nodes", "16",
                "--gpus-per-node", "8", "--gpu-mem", "80")  # fmt: skip
    assert "TP" in plan and "qwen3-32b" in plan
    assert "--hf-template" in dapo("convert", "megatron-to-hf", "--help")
    assert "--model-config" in dapo("convert", "hf-to-megatron", "--help")
    rehearsal = dapo("rehearse", "--recipe", "dapo_7b", "--no-step")  # a recipe and its architecture, from the package
    assert "dapo_7b" in rehearsal, rehearsal[-2000:]
