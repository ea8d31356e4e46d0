"""tools/gpu_smoke.py: what a CPU can check (arguments, the configurations it builds); the GPU run is `make gpu-smoke`."""

import subprocess
import sys

from tests.helpers import REPO

SMOKE = [sys.executable, str(REPO / "tools" / "gpu_smoke.py")]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SMOKE, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_cpu_check_builds_the_configurations():
    out = run("--cpu-check", "--groups", "2", "--response-len", "64")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cpu-check: qwen2.5-0.5b, 16 sequences" in out.stdout and "GiB" in out.stdout


def test_bad_arguments_and_no_gpu_are_clear_errors():
    bad = run("--steps", "0")
    assert bad.returncode == 2 and "--steps = 0: must be >= 1" in bad.stderr
    unknown = run("--arch", "no-such-model", "--cpu-check")
    assert unknown.returncode != 0 and "no-such-model" in unknown.stderr
    no_gpu = run()
    assert no_gpu.returncode == 2 and "no CUDA device" in no_gpu.stderr
