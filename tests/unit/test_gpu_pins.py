"""The GPU stack's install files agree (issue 22 #11): requirements/gpu.txt, docker/Dockerfile, pyproject.toml,
requirements/mcore-latest.txt, megatron_dapo/versions.py, the sbatch scripts, and sglang 0.5.23's own metadata."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re

import pytest
import tomllib

from megatron_dapo.versions import MCORE_RANGE, in_range
from tests.helpers import REPO

_spec = importlib.util.spec_from_file_location("check_stack", REPO / "docker" / "check_stack.py")
check_stack = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_stack)

PINS = check_stack.read_pins(REPO / "requirements" / "gpu.txt")
DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()
# Dockerfile ARG -> the requirements/gpu.txt pins it must equal
ARG_PINS = {
    "TORCH_VERSION": ["torch"],
    "SGLANG_VERSION": ["sglang"],
    "SGLANG_KERNEL_VERSION": ["sglang-kernel"],
    "FLASHINFER_VERSION": ["flashinfer-python"],
    "TE_VERSION": ["transformer-engine", "transformer-engine-cu13", "transformer-engine-torch"],
    "MCORE_VERSION": ["megatron-core"],
    "APEX_COMMIT": ["apex"],
}


def _dockerfile_args() -> dict[str, str]:
    return {m[1]: m[2].strip('"') for m in re.finditer(r"^ARG (\w+)=(\S+)", DOCKERFILE, re.M)}


def _requirements(path) -> dict[str, str]:
    return check_stack.read_pins(path)


def test_gpu_txt_pins_the_whole_stack():
    for name in (
        "torch",
        "sglang",
        "sglang-kernel",
        "flashinfer-python",
        "transformer-engine",
        "megatron-core",
        "apex",
    ):
        assert name in PINS, f"requirements/gpu.txt pins no {name}"
    assert re.fullmatch(r"[0-9a-f]{40}", PINS["apex"])


def test_dockerfile_pins_equal_gpu_txt():
    args = _dockerfile_args()
    for arg, names in ARG_PINS.items():
        assert arg in args, f"docker/Dockerfile has no ARG {arg}"
        for name in names:
            assert args[arg] == PINS[name], f"docker/Dockerfile ARG {arg}={args[arg]}, requirements/gpu.txt {name}"
    # the base is SGLang's image of the pinned release, for torch's CUDA (PyPI's torch 2.14.1 is the CUDA 13.0 build)
    assert args["SGLANG_IMAGE"] == f"lmsysorg/sglang:v{PINS['sglang']}-cu130"


def test_dockerfile_installs_only_under_the_constraints():
    steps = re.findall(r"pip install[^\n]*(?:\\\n[^\n]*)*", DOCKERFILE)
    assert len(steps) >= 4
    for step in steps:
        assert "-c requirements/gpu.txt" in step, f"a pip step without the constraints: {step!r}"
    assert "pip install -v --no-build-isolation -c requirements/gpu.txt" in DOCKERFILE  # TE, apex: against its torch
    # the base is checked before anything is built on it, and the result against every pin at the end
    assert "check_stack.py torch sglang sglang-kernel flashinfer-python" in DOCKERFILE
    assert re.search(r"then python3 docker/check_stack.py; else", DOCKERFILE)


def test_megatron_core_is_one_tested_range():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    mcore = [d for d in project["dependencies"] if re.match(r"megatron-core\b", d)]
    assert mcore == [f"megatron-core{MCORE_RANGE}"], "pyproject.toml's megatron-core must be versions.MCORE_RANGE"
    assert in_range(PINS["megatron-core"], MCORE_RANGE)
    latest = _requirements(REPO / "requirements" / "mcore-latest.txt")
    # `make test-mcore-latest` tests the GPU stack's megatron-core, on the GPU stack's torch
    assert latest == {"torch": PINS["torch"], "megatron-core": PINS["megatron-core"]}
    cpu = re.search(r"^MCORE\s*\?=\s*megatron-core==(\S+)", (REPO / "Makefile").read_text(), re.M)
    assert cpu and in_range(cpu[1], MCORE_RANGE)


def test_no_extra_installs_the_gpu_stack_unconstrained():
    """An extra that names sglang or TE lets pip replace a container's torch (sglang pins torch==2.14.1)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    for extra, reqs in extras.items():
        for req in reqs:
            name = check_stack.canonical(re.match(r"[A-Za-z0-9._-]+", req)[0])
            assert name not in PINS or name == "transformers", f"[{extra}] installs {req}: use requirements/gpu.txt"


def test_gpu_txt_agrees_with_sglangs_own_metadata():
    """sglang's exact pins (its installed METADATA: the real 0.5.23 in the CPU .venv) are ours."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version != PINS["sglang"]:
        msg = f"sglang {PINS['sglang']} is not installed here (found {version})"
        if os.environ.get("DAPO_REQUIRE_SGLANG") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    compared = set()
    for req in importlib.metadata.requires("sglang"):
        if ";" in req and "extra ==" in req:
            continue
        m = re.match(r"([A-Za-z0-9._-]+)(\[[^\]]*\])?\s*==\s*([^\s;,]+)", req)
        if m and check_stack.canonical(m[1]) in PINS:
            name = check_stack.canonical(m[1])
            assert PINS[name] == m[3], (
                f"sglang {version} requires {req}; requirements/gpu.txt pins {name}=={PINS[name]}"
            )
            compared.add(name)
    assert compared >= {"torch", "sglang-kernel", "flashinfer-python", "transformers"}, compared


def test_sbatch_container_image_names_the_image():
    for path in sorted((REPO / "slurm").glob("*.sbatch")):
        text = path.read_text()
        if "CONTAINER_IMAGE=" not in text:
            continue
        head = text[: text.index("CONTAINER_IMAGE=")].rsplit("\n\n", 1)[-1]
        assert "docker/Dockerfile" in head and "enroot import" in head, f"{path.name}: CONTAINER_IMAGE comment"


def test_check_stack_reports_what_differs():
    import torch

    mine = torch.__version__.split("+")[0]
    assert check_stack.problems({"torch": mine}) == []
    assert check_stack.problems({"torch": "0.0.1"}) == [f"torch: {torch.__version__} installed, want 0.0.1"]
    assert check_stack.problems({"no-such-package-xyz": "1.0"}) == ["no-such-package-xyz: not installed (want 1.0)"]
    assert check_stack.problems({"torch": "0.0.1"}, without=("torch",)) == []


def test_check_stack_refuses_a_range(tmp_path):
    bad = tmp_path / "gpu.txt"
    bad.write_text("torch>=2.14\n")
    with pytest.raises(ValueError, match="expected name==version"):
        check_stack.read_pins(bad)


def _run_steps() -> list[str]:
    """The Dockerfile's RUN steps, continuation lines joined."""
    return [m.replace("\\\n", " ") for m in re.findall(r"^RUN (?:[^\n]*\\\n)*[^\n]*", DOCKERFILE, re.M)]


def test_dockerfile_builds_te_without_nccl_ep_and_with_nccl_headers():
    """TE 2.19's torch extension compiles NCCL EP unless NVTE_WITH_NCCL_EP=0 (build_tools/pytorch.py:92) and always
    includes nccl.h (transformer_engine/pytorch/csrc/extensions.h:10)."""
    (te,) = [step for step in _run_steps() if "transformer-engine[" in step]
    assert re.search(r"\bNVTE_WITH_NCCL_EP=0 ", te), te
    # nccl.h is looked for before the build, put on the compiler's path, and its absence stops the build
    assert re.search(r'CPATH="\$\{NCCL_INCLUDE\}', te) and "nccl.h" in te and "exit 1" in te
    assert te.index("exit 1") < te.index("pip install")


def test_dockerfile_checks_the_python_every_pin_requires():
    args = _dockerfile_args()
    want = args.get("PYTHON_VERSION")
    assert want and re.fullmatch(r"3\.\d+", want), "docker/Dockerfile needs ARG PYTHON_VERSION=3.N"
    steps = _run_steps()
    checks = [i for i, step in enumerate(steps) if 'check_stack.py --python "${PYTHON_VERSION}"' in step]
    first_pip = min(i for i, step in enumerate(steps) if "pip install" in step)
    assert checks and checks[0] < first_pip, "the Python check runs before anything is installed"
    # the version agrees with the pins' Requires-Python, and with the one requirements/gpu.txt states
    assert set(check_stack.REQUIRES_PYTHON) <= set(PINS)
    assert check_stack.python_problems(want) == []
    stated = re.search(r"^# .*\bPython (3\.\d+)\b", (REPO / "requirements" / "gpu.txt").read_text(), re.M)
    assert stated and stated[1] == want
    # the check itself: a Python a pin excludes, and a base image with another Python, are named
    older = f"3.{int(want.split('.')[1]) - 1}"
    assert any("megatron-core requires Python >=3.12" in p for p in check_stack.python_problems("3.11"))
    assert check_stack.check_python(want, running=f"{want}.4") == []
    assert "ARG PYTHON_VERSION" in " ".join(check_stack.check_python(want, running=f"{older}.9"))
    assert check_stack.python_problems("3.13", {"x": ">=3.10,<3.13"}) == ["python 3.13: x requires Python >=3.10,<3.13"]


@pytest.mark.parametrize("name", sorted(check_stack.REQUIRES_PYTHON))
def test_requires_python_is_the_installed_metadata(name):
    """The recorded Requires-Python of each pin, against its installed metadata where this is the pinned release."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed here")
    if dist.version.split("+")[0] != PINS[name]:
        pytest.skip(f"{name} {dist.version} installed, the pin is {PINS[name]}")
    assert dist.metadata["Requires-Python"].replace(" ", "") == check_stack.REQUIRES_PYTHON[name]
