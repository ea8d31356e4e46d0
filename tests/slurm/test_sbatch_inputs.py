"""Issue 48 #4: the GPU sbatch scripts on first contact with a cluster. They find the repository wherever they are
submitted from (sbatch runs a spool copy), check every input on the batch node before any step (one line per problem,
naming the variable; all of them), take the layout from the recipe alone, and with a container check the driver's
python on the host and the GPU stack in the image before any server step. Most of it runs the scripts with bash and
stand-ins (no Slurm); two jobs run on the real local Slurm (conftest.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.slurm.test_launch_plan import ONE_NODE, QWEN32B_CONFIG, R32

pytestmark = pytest.mark.timeout(120)
INPUT_VARS = ("HF_CKPT", "TRAIN_FILES", "EVAL_FILES", "RUN_DIR", "SOCKET_IFNAME", "IB_HCA")
ENV = {k: v for k, v in os.environ.items()
       if not k.startswith(("SLURM_", "CONTAINER_", "PYTHON", "DAPO_", *INPUT_VARS))}  # fmt: skip
GPU_SCRIPTS = ["dapo_32b.sbatch", "dapo_qwen3_32b.sbatch", "dapo_qwen3_30b_a3b.sbatch", "dapo_7b.sbatch"]
ALL_SCRIPTS = sorted(p.name for p in (REPO / "slurm").glob("*.sbatch"))


def make_inputs(root: Path) -> dict[str, str]:
    """Valid inputs under ``root``: an HF checkpoint directory of Qwen2.5-32B's shape, two parquet files, a run dir."""
    hf = root / "Qwen2.5-32B"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps(QWEN32B_CONFIG))
    (hf / "model.safetensors").write_bytes(b"")  # present; the plan reads only config.json
    data = root / "data"
    data.mkdir()
    for name in ("dapo-math-17k.parquet", "aime-2024.parquet"):
        (data / name).write_bytes(b"PAR1")
    return {"HF_CKPT": str(hf), "TRAIN_FILES": str(data / "dapo-math-17k.parquet"),
            "EVAL_FILES": str(data / "aime-2024.parquet"), "RUN_DIR": str(root / "runs")}  # fmt: skip


def bash(script: Path | str, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env={**ENV, **env}, capture_output=True, text=True,
                          timeout=100)  # fmt: skip


# ---- the repository, wherever the job was submitted from --------------------------------------------------------------


def repository_block(text: str) -> str:
    start = text.index("# ---- the repository")
    return text[start : text.index("\n# ------", start)]


def test_every_script_opens_with_the_same_repository_lines():
    """The lines that find slurm/common.sh are copied into each script (they run before it is found): kept equal."""
    blocks = {name: repository_block((REPO / "slurm" / name).read_text()) for name in ALL_SCRIPTS}
    assert len(set(blocks.values())) == 1, sorted(blocks)
    block = blocks["dapo_32b.sbatch"]
    assert "$(" not in block and "`" not in block  # builtins only (slurm/common.sh: bash 5.2 and SIGUSR1)
    assert set(GPU_SCRIPTS) < set(ALL_SCRIPTS) and "dapo_tiny_cpu.sbatch" in ALL_SCRIPTS


@pytest.fixture
def spool(tmp_path):
    """A job as slurmd runs it: a copy of the script in a spool directory, submitted from another directory, with a
    stand-in scontrol that answers ``Command=`` (the script as submitted, and arguments) and, like a time-limit signal
    landing as the job starts, sends SIGUSR1 to the script before it has found slurm/common.sh."""
    bin_dir, elsewhere = tmp_path / "bin", tmp_path / "elsewhere"
    bin_dir.mkdir()
    elsewhere.mkdir()

    def run(script: str, command: str, *args: str, **env: str) -> subprocess.CompletedProcess:
        (bin_dir / "scontrol").write_text(
            f"#!/bin/sh\nkill -USR1 $PPID\nprintf '   Priority=1\\n   Command={command}\\n'\n"
        )
        (bin_dir / "scontrol").chmod(0o755)
        copy = tmp_path / "spool" / "job77" / "slurm_script"
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text((REPO / "slurm" / script).read_text())
        env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": str(elsewhere),
               "TMPDIR": str(tmp_path), **env}  # fmt: skip
        return bash(copy, *args, cwd=elsewhere, **env)

    return run


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_a_spool_copy_submitted_elsewhere_finds_the_repository(script, spool, tmp_path):
    inputs = make_inputs(tmp_path / "in")
    missing = str(tmp_path / "in" / "data" / "gone.parquet")
    # Command= has the arguments after the script, one of them a path
    out = spool(script, f"{REPO}/slurm/{script} --recipe /x/y.yaml --dry-run", "--dry-run",
                **{**inputs, "TRAIN_FILES": missing})  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert f", repo {REPO}\n" in out.stderr and "SIGUSR1 (time limit near)" in out.stderr  # the early signal kept
    assert f"TRAIN_FILES={missing}: no such file\n" in out.stderr and "== launch" not in out.stderr
    assert "No such file or directory" not in out.stderr and "command not found" not in out.stderr
    assert not list(tmp_path.glob("dapo-job-*"))  # scontrol's answer removed


@pytest.mark.parametrize("script", ["dapo_32b.sbatch", "dapo_tiny_cpu.sbatch"])
def test_no_repository_found_is_one_line_naming_dapo_root(script, spool, tmp_path):
    for command, env, line in [
        (
            "(null)",
            {},
            "cannot find the megatron-dapo checkout (slurm/common.sh is neither beside the submitted script "
            f"nor in the submission directory {tmp_path}/elsewhere): export DAPO_ROOT=<the checkout> and "
            "submit again\n",
        ),  # fmt: skip
        (
            f"{REPO}/slurm/{script}",
            {"DAPO_ROOT": "/nonexistent"},
            "DAPO_ROOT=/nonexistent has no slurm/common.sh: set DAPO_ROOT to the megatron-dapo checkout\n",
        ),
    ]:
        out = spool(script, command, **env)
        assert (out.returncode, out.stderr) == (2, line), out.stderr


# ---- the inputs, checked before any step ------------------------------------------------------------------------------


def check_inputs(tmp_path: Path, *specs: str, **env: str) -> subprocess.CompletedProcess:
    job = tmp_path / "job.sh"
    job.write_text(f"source {REPO}/slurm/common.sh\ndapo_check_inputs {' '.join(specs)}\nphase checked\n")
    return bash(job, cwd=tmp_path, DAPO_ROOT=str(REPO), TMPDIR=str(tmp_path), **env)


def problems(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in out.stderr.splitlines() if not line.startswith("[")]


def test_check_inputs_names_every_problem(tmp_path):
    ok = make_inputs(tmp_path / "in")
    (tmp_path / "a-file").write_text("")
    bare = tmp_path / "bare"  # a directory without the checkpoint's files
    bare.mkdir()
    specs = ("model:HF_CKPT", "files:TRAIN_FILES", "files:EVAL_FILES", "outdir:RUN_DIR", "image:CONTAINER_IMAGE",
             "ifname:SOCKET_IFNAME")  # fmt: skip
    out = check_inputs(tmp_path, *specs, **ok, SOCKET_IFNAME="lo")
    assert out.returncode == 0 and problems(out) == [] and "== checked" in out.stderr, out.stderr
    bad = {"HF_CKPT": str(bare), "TRAIN_FILES": f"{ok['TRAIN_FILES']},{tmp_path}/gone.parquet,{tmp_path}/in/data",
           "EVAL_FILES": "", "RUN_DIR": f"{tmp_path}/a-file/runs", "CONTAINER_IMAGE": f"{tmp_path}/dapo.sqsh",
           "SOCKET_IFNAME": "lo,nosuch0", "CONTAINER_MOUNTS": f"{tmp_path}:{tmp_path}"}  # fmt: skip
    out = check_inputs(tmp_path, *specs, **bad)
    assert out.returncode == 2 and "== checked" not in out.stderr
    got = problems(out)
    assert got[:6] == [
        f"HF_CKPT={bare}: no config.json (not a Hugging Face checkpoint directory)",
        f"TRAIN_FILES={tmp_path}/gone.parquet: no such file",
        f"TRAIN_FILES={tmp_path}/in/data: not a readable file",
        "EVAL_FILES is empty",
        f"RUN_DIR={tmp_path}/a-file/runs: cannot be created ({tmp_path}/a-file is not a writable directory)",
        f"CONTAINER_IMAGE={tmp_path}/dapo.sqsh: no such file (a squashfs image: enroot import -o {tmp_path}/dapo.sqsh ...)",
    ], got  # fmt: skip
    assert re.fullmatch(r"SOCKET_IFNAME=nosuch0: no such network interface on \S+ \(it has:.* lo\b.*\)", got[6]), got
    assert len(got) == 7 and "7 problem(s) with the inputs above: nothing was started" in out.stderr
    (bare / "config.json").write_text("{}")
    assert problems(check_inputs(tmp_path, "model:HF_CKPT", HF_CKPT=str(bare))) == [
        f"HF_CKPT={bare}: no *.safetensors (not a Hugging Face checkpoint directory)"]  # fmt: skip
    # a run directory that does not exist yet, relative (to the repository) or absolute; a registry image
    out = check_inputs(tmp_path, "outdir:RUN_DIR", "outdir:OUT2", "ifname:SOCKET_IFNAME", RUN_DIR="runs/new/deeper",
                       OUT2=f"{tmp_path}/x/y")  # fmt: skip
    assert out.returncode == 0 and problems(out) == [], out.stderr
    assert "SOCKET_IFNAME is empty: NCCL picks its sockets' interface itself" in out.stderr  # said, not refused
    out = check_inputs(tmp_path, "image:CONTAINER_IMAGE", CONTAINER_IMAGE="nvcr.io#nvidia/x:1")
    assert out.returncode == 0 and problems(out) == [], out.stderr


def test_with_a_container_every_path_must_be_mounted_where_it_is(tmp_path):
    ok = make_inputs(tmp_path / "in")
    specs = ("model:HF_CKPT", "files:TRAIN_FILES", "files:EVAL_FILES", "outdir:RUN_DIR")
    image = {"CONTAINER_IMAGE": "nvcr.io#nvidia/x:1"}
    out = check_inputs(
        tmp_path, *specs, **ok, **image, CONTAINER_MOUNTS=f"/shared:/shared,{tmp_path}/in:{tmp_path}/in:ro"
    )
    assert out.returncode == 0 and problems(out) == [], out.stderr
    # mounted elsewhere (SRC:DST): the path in the variable is not the path the steps see; RUN_DIR=runs: in DAPO_ROOT
    out = check_inputs(tmp_path, *specs, **{**ok, "RUN_DIR": "runs"}, **image, CONTAINER_MOUNTS=f"{tmp_path}/in:/in")
    assert out.returncode == 2
    note = f": not under DAPO_ROOT or a CONTAINER_MOUNTS entry mounted at its own path (CONTAINER_MOUNTS={tmp_path}" \
           "/in:/in): the steps in CONTAINER_IMAGE would not see it"  # fmt: skip
    assert problems(out) == [f"{var}={ok[var]}{note}" for var in ("HF_CKPT", "TRAIN_FILES", "EVAL_FILES")]


# ---- the layout: the recipe's alone ----------------------------------------------------------------------------------


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_the_scripts_pass_no_layout_of_their_own(script):
    """A PARALLEL=(parallel.tp=8 ...) list in the script won over the recipe: a recipe changed to TP 4 still ran TP 8.
    The layout keys are the recipe's (what the script passes is paths, image, network)."""
    code = [line for line in (REPO / "slurm" / script).read_text().splitlines() if not line.lstrip().startswith("#")]
    layout = re.compile(r"\b(parallel\.\w+|model\.(fp8|recompute)|rollout\.(sglang\.tp|mem_fraction))=")
    assert not [line for line in code if layout.search(line)]
    assert "PARALLEL" not in "\n".join(code)


# ---- a container: the driver's python on the host, the GPU stack in the image ------------------------------------------


def test_with_a_container_the_drivers_python_is_checked_on_the_host(tmp_path):
    inputs = make_inputs(tmp_path / "in")
    image = {"CONTAINER_IMAGE": "nvcr.io#nvidia/x:1", "CONTAINER_MOUNTS": f"{tmp_path}:{tmp_path}"}
    out = bash(REPO / "slurm" / "dapo_32b.sbatch", cwd=tmp_path, PYTHON="/usr/bin/false", **inputs, **image)
    assert out.returncode == 3 and "FAILED in phase check python" in out.stderr, out.stderr
    assert "the driver runs on the batch node outside CONTAINER_IMAGE (it starts the steps with srun), but " \
           "PYTHON=/usr/bin/false cannot import megatron_dapo.launch.slurm" in out.stderr  # fmt: skip
    out = bash(REPO / "slurm" / "dapo_32b.sbatch", cwd=tmp_path, PYTHON=sys.executable, **inputs, **image)
    assert "== launch" in out.stderr and "not inside a Slurm allocation" in out.stderr, out.stderr  # a CPU torch does


@pytest.mark.timeout(180)
def test_in_a_container_the_gpu_preflight_runs_in_the_image_before_any_server(tmp_path, monkeypatch, capsys):
    """The driver's preflight (CUDA torch, the GPUs, TE, SGLang, megatron-core) probes the image's python, one task on
    the first node, before any server step: an image with a CPU torch (this venv stands in for it) fails there."""
    from megatron_dapo.launch.slurm import main

    bin_dir, calls = tmp_path / "bin", tmp_path / "srun-calls"
    bin_dir.mkdir()
    # srun with pyxis, standing in: records its arguments, drops its options, runs the command ("python": the image's)
    (bin_dir / "srun").write_text(
        f'#!/bin/bash\necho "$@" >> {calls}\nwhile [[ $1 == --* ]]; do shift; done\n'
        f'[[ $1 == python ]] && {{ shift; set -- {sys.executable} "$@"; }}\nexec "$@"\n'
    )
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key in [k for k in os.environ if k.startswith(("SLURM_", "MASTER_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    rc = main(["--recipe", R32, "--log-dir", str(tmp_path / "logs"), *ONE_NODE, "--nodes", "1",
               "cluster.container_image=registry.example/dapo:1"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "dapo launch (in cluster.container_image = registry.example/dapo:1): preflight" in err, err
    assert "is a CPU build, but the job runs on CUDA devices" in err
    (step,) = calls.read_text().splitlines()  # the preflight only: no server step, no trainer step
    assert "--container-image=registry.example/dapo:1" in step and "--job-name=dapo-preflight" in step
    assert all(f in step.split() for f in ("--nodes=1", "--ntasks=1", "--nodelist=n1", "--gpus-per-node=8"))
    assert " python -m megatron_dapo.launch.preflight " in step


# ---- on the real local Slurm ------------------------------------------------------------------------------------------


def recording_srun(tmp_path: Path) -> tuple[dict, Path]:
    """PATH with an srun that records each call and runs the real one: the file exists only if a step was started."""
    real = subprocess.run(["bash", "-c", "command -v srun"], capture_output=True, text=True).stdout.strip()
    bin_dir, calls = tmp_path / "bin", tmp_path / "srun-calls"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {real} "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, calls


@pytest.mark.slurm
def test_submitted_from_elsewhere_a_missing_parquet_fails_before_any_step(local_slurm, tmp_path):
    """Issue 48 #4's acceptance: `cd elsewhere && sbatch /path/to/slurm/dapo_32b.sbatch` with a missing parquet (and
    more wrong) ends at once, each problem one line naming the variable and its value, no step started."""
    inputs = make_inputs(tmp_path / "in")
    (tmp_path / "in" / "Qwen2.5-32B" / "config.json").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    path_env, calls = recording_srun(tmp_path)
    gone = f"{tmp_path}/in/data/dapo-math-17k-gone.parquet"
    env = {**{k: v for k, v in local_slurm.env.items() if not k.startswith(("DAPO_", *INPUT_VARS))}, **inputs,
           **path_env, "TRAIN_FILES": gone, "SOCKET_IFNAME": "nosuch0"}  # fmt: skip
    job = local_slurm.submit("--nodes=2", f"--output={tmp_path}/out", f"{REPO}/slurm/dapo_32b.sbatch", env=env,
                             cwd=elsewhere)  # fmt: skip
    state, code, waited = local_slurm.wait(job, 60)
    err = (tmp_path / "out").read_text()
    assert (state, code) == ("FAILED", "2:0"), err
    assert f", repo {REPO}\n" in err and "account root, partition debug" in err  # found; what the job got
    assert f"TRAIN_FILES={gone}: no such file\n" in err
    assert f"HF_CKPT={inputs['HF_CKPT']}: no config.json (not a Hugging Face checkpoint directory)\n" in err
    assert "SOCKET_IFNAME=nosuch0: no such network interface on n1" in err
    assert "3 problem(s) with the inputs above: nothing was started" in err
    assert "== check python" not in err and "== launch" not in err and not calls.exists()
    assert not Path(inputs["RUN_DIR"]).exists()


@pytest.mark.slurm
def test_a_recipe_changed_to_tp4_is_the_plan_submitted(local_slurm, tmp_path):
    """The layout is the recipe's: a copy of dapo_32b at TP 4, given to the real sbatch script, plans TP 4 (the script's
    own PARALLEL=(parallel.tp=8 ...) list once won). Submitted from another directory, --dry-run inside the job."""
    recipe = tmp_path / "dapo_32b_tp4.yaml"
    recipe.write_text("base: dapo_32b\nparallel:\n  tp: 4\n")
    inputs = make_inputs(tmp_path / "in")
    env = {**{k: v for k, v in local_slurm.env.items() if not k.startswith(("DAPO_", *INPUT_VARS))}, **inputs}
    # 32B on 2 nodes is predicted not to fit an 80 GiB GPU: the driver would refuse it; this checks the plan
    job = local_slurm.submit("--nodes=2", f"--output={tmp_path}/out", f"--error={tmp_path}/err",
                             f"{REPO}/slurm/dapo_32b.sbatch", "--recipe", str(recipe), "--dry-run", "--json",
                             "cluster.memory_check=false", env=env, cwd=tmp_path)  # fmt: skip
    state, code, _ = local_slurm.wait(job, 90)
    err = (tmp_path / "err").read_text()
    assert state == "COMPLETED", f"{state} {code}\n{err}"
    plan = json.loads((tmp_path / "out").read_text())
    assert (plan["tp"], plan["pp"], plan["cp"], plan["dp"], plan["world_size"]) == (4, 2, 1, 2, 16)
    assert plan["recipe"] == str(recipe) and plan["nodes"] == ["n1", "n2"]
    trainer = plan["trainer"]["command"]
    assert not [a for a in trainer if a.startswith(("parallel.", "model.fp8", "rollout.sglang.tp"))], trainer
    assert f"model.hf_init={inputs['HF_CKPT']}" in trainer and "== check inputs" in err
