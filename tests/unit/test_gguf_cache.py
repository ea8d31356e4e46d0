"""GGUF → HF directory, once (``megatron_dapo/models/gguf.py``, ``tools/gguf_to_hf.py``): built the first time,
found the next, never left half-written. The dequantization itself runs on the real SmolLM2 GGUF in
``tests/dist/test_bridge_smollm.py``; here it is replaced by a stub that writes what a build writes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_dapo.models import gguf as G
from tests.helpers import REPO


@pytest.fixture
def fake_gguf(tmp_path):
    f = tmp_path / "Tiny-1M-Instruct.Q4_1.gguf"
    f.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    return f


def _stub(calls):
    def dequantize(gguf, out, log=lambda s: None):
        calls.append(out)
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"x")

    return dequantize


def test_built_once_then_found(tmp_path, fake_gguf, monkeypatch):
    calls = []
    monkeypatch.setattr(G, "dequantize", _stub(calls))
    first = G.cached_hf_dir(fake_gguf, tmp_path / "models")
    second = G.cached_hf_dir(fake_gguf, tmp_path / "models")
    assert first == second and len(calls) == 1
    assert first.name == f"tiny-1m-instruct-{G.file_digest(fake_gguf)}"
    assert sorted(p.name for p in first.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.name]  # no temporary left behind
    fake_gguf.write_bytes(b"GGUF another model")  # another file: another directory, built anew
    assert G.cached_hf_dir(fake_gguf, tmp_path / "models") != first and len(calls) == 2


def test_an_interrupted_build_leaves_nothing_that_looks_built(tmp_path, fake_gguf, monkeypatch):
    def broken(gguf, out, log=lambda s: None):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(G, "dequantize", broken)
    with pytest.raises(KeyboardInterrupt):
        G.cached_hf_dir(fake_gguf, tmp_path / "models")
    assert list((tmp_path / "models").iterdir()) == []
    calls = []
    monkeypatch.setattr(G, "dequantize", _stub(calls))
    assert (G.cached_hf_dir(fake_gguf, tmp_path / "models") / "config.json").is_file() and len(calls) == 1


def test_models_dir_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(G.MODELS_ENV, str(tmp_path / "m"))
    assert G.models_dir() == tmp_path / "m"
    monkeypatch.delenv(G.MODELS_ENV)
    assert G.models_dir().parts[-3:] == (".cache", "megatron-dapo", "models")


def test_tool_prints_the_directory_of_a_cached_build(tmp_path, fake_gguf):
    target = tmp_path / f"tiny-{G.file_digest(fake_gguf)}"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"x")
    args = ["--gguf", str(fake_gguf), "--models-dir", str(tmp_path), "--name", "tiny"]
    proc = subprocess.run([sys.executable, "tools/gguf_to_hf.py", *args], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(target) and "cached" in proc.stderr
    proc = subprocess.run([sys.executable, "tools/gguf_to_hf.py", "--gguf", str(tmp_path / "none.gguf")], cwd=REPO,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "no such file" in proc.stderr
