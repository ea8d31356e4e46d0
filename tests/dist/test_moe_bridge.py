"""Qwen3-MoE at TP=2 x EP=2 x PP=2 (8 torchrun processes, gloo): the HF weights load into megatron-core's MoE model
with every rank holding exactly its experts and shards; the conversion tools take --ep and `tools/check_logits.py`
matches transformers' logits there, and fails on a checkpoint whose experts are swapped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from bridge_helpers import free_port, save_hf  # noqa: E402

from megatron_dapo.models.arch import load_arch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = load_arch("tiny-moe")
pytestmark = pytest.mark.dist


def _run(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout, capture_output=True, text=True)


@pytest.mark.timeout(600)
def test_every_rank_holds_its_experts_and_shards(tmp_path):
    hf = save_hf(TINY, tmp_path / "hf", seed=11)
    out = tmp_path / "ranks.pt"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=8", f"--master-port={free_port()}",
        "--master-addr=127.0.0.1", "tests/dist/moe_load_worker.py", str(hf), "2", "2", "2", str(out),
    ]  # fmt: skip
    proc = _run(cmd)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ranks = torch.load(out)
    assert sorted(key for key, _, _ in ranks) == [(s, e, t) for s in (0, 1) for e in (0, 1) for t in (0, 1)]
    assert [p for _, _, problems in ranks for p in problems] == []


@pytest.mark.timeout(900)
def test_check_logits_at_tp2_ep2_pp2(tmp_path):
    hf = save_hf(TINY, tmp_path / "hf", seed=12)
    conv = _run([sys.executable, "tools/convert_hf_to_megatron.py", "--hf", str(hf), "--out", str(tmp_path / "mg"),
                 "--tp", "2", "--pp", "2", "--ep", "2", "--quiet"])  # fmt: skip
    assert conv.returncode == 0 and "6 experts" in conv.stdout, conv.stderr[-3000:]
    check = [sys.executable, "tools/check_logits.py", "--megatron", str(tmp_path / "mg"), "--tp", "2", "--pp", "2",
             "--ep", "2"]  # fmt: skip
    proc = _run([*check, "--hf", str(hf)])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "tp=2 pp=2 ep=2" in proc.stdout and "-> OK" in proc.stdout
    # The same model with two experts of layer 0 swapped in the HF checkpoint: the logits must differ (checked at EP 2
    # alone, 2 ranks instead of 8: the checkpoint reshards on load, and a swap shows at any layout)
    from safetensors.torch import load_file, save_file

    swapped = tmp_path / "swapped"
    save_hf(TINY, swapped, seed=12)
    sd = load_file(swapped / "model.safetensors")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        a, b = f"model.layers.0.mlp.experts.1.{proj}.weight", f"model.layers.0.mlp.experts.4.{proj}.weight"
        sd[a], sd[b] = sd[b], sd[a]
    save_file(sd, swapped / "model.safetensors", metadata={"format": "pt"})
    ep_only = [sys.executable, "tools/check_logits.py", "--megatron", str(tmp_path / "mg"), "--ep", "2"]
    proc = _run([*ep_only, "--hf", str(swapped)])
    assert proc.returncode == 1 and "-> FAIL" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
