"""tools/gpu_smoke.py: what a CPU can check (arguments, the configurations it builds, the weight-bucket hand-off with
SGLang's own serializer, safe unpickler and loader); the GPU run is `make gpu-smoke`."""

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

SMOKE = [sys.executable, str(REPO / "tools" / "gpu_smoke.py")]
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*SMOKE, *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})  # fmt: skip


def test_cpu_check_builds_the_configurations_and_hands_a_bucket_over():
    if not HAVE_SGLANG and os.environ.get("DAPO_REQUIRE_SGLANG") == "1":
        pytest.fail("DAPO_REQUIRE_SGLANG=1 but sglang is not installed: the IPC contract would be skipped")
    out = run("--cpu-check", "--groups", "2", "--response-len", "64")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "cpu-check: qwen2.5-0.5b, 16 sequences" in out.stdout and "GiB" in out.stdout
    row = next(line for line in out.stdout.splitlines() if "weight-bucket hand-off" in line)
    assert ": ok: " in row and "checksums equal" in row and "2 TP ranks" in row, row
    if HAVE_SGLANG:  # issue 22 #12: the real contract, not dict metadata and plain pickle
        assert "FlattenedTensorBucket + SGLang's MultiprocessingSerializer / SafeUnpickler" in row, row
        assert "skipped SGLang" not in out.stdout
    else:
        assert "skipped SGLang's transport contract (sglang not importable)" in out.stdout


def test_the_hand_off_fails_when_sglang_refuses_the_payload(monkeypatch):
    """The consumer really reads through SGLang's SafeUnpickler: an allow-list without torch's storage rebuild
    refuses the payload, and the row says FAILED."""
    pytest.importorskip("sglang")
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_smoke
    import sglang.srt.utils.common as common

    monkeypatch.setattr(common.SafeUnpickler, "find_class", lambda self, mod, name: (_ for _ in ()).throw(
        RuntimeError(f"refused {mod}.{name}")))  # fmt: skip
    import queue as q

    import torch

    from megatron_dapo.engines.sglang.client import SGLangEngine
    from megatron_dapo.engines.sglang.server import SGLangServer
    from megatron_dapo.engines.sglang.sync import TensorSync

    engine = SGLangEngine([SGLangServer.attach("http://127.0.0.1:9", device="cpu")], dtype="bfloat16", start=False)
    _, blob, _ = TensorSync(engine, verify="off").serialize([("w", torch.ones(4))])
    box = q.Queue()
    gpu_smoke._consume([blob], "cpu", "sglang", box)  # in this process: the patched unpickler
    status, message = box.get()
    assert status == "error" and "refused" in message, message


def test_bad_arguments_and_no_gpu_are_clear_errors():
    bad = run("--steps", "0")
    assert bad.returncode == 2 and "--steps = 0: must be >= 1" in bad.stderr
    unknown = run("--arch", "no-such-model", "--cpu-check")
    assert unknown.returncode != 0 and "no-such-model" in unknown.stderr
    no_gpu = run(env={"CUDA_VISIBLE_DEVICES": ""})  # no GPU visible, on a CUDA host as on a CPU one
    assert no_gpu.returncode == 2 and "no CUDA device" in no_gpu.stderr
