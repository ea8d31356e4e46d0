"""Checkpoint conversion HF ⇄ Megatron: bit-exact round trips, and every bad input refused before writing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bridge_helpers import LLAMA_TINY, QWEN2_TINY, save_hf
from safetensors.torch import load_file, save_file

from megatron_dapo.bridge.convert import hf_to_megatron, parse_size, read_meta
from megatron_dapo.bridge.convert_to_hf import megatron_to_hf
from megatron_dapo.config.typed_yaml import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def tensors(d: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "tools" / name), *args, "--quiet"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


def no_leftovers(out: Path) -> None:
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "arch,dtype,shard", [(QWEN2_TINY, torch.bfloat16, "60KB"), (LLAMA_TINY, torch.float32, "10MB")],
    ids=["qwen2-bf16-sharded", "llama-fp32-tied-single"],
)  # fmt: skip
def test_round_trip_is_bit_exact(tmp_path, arch, dtype, shard):
    from transformers import AutoModelForCausalLM

    hf = save_hf(arch, tmp_path / "hf", seed=5, dtype=dtype, max_shard_size=shard)
    (hf / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    assert (hf / "model.safetensors.index.json").is_file() == (shard == "60KB")
    hf_to_megatron(hf, tmp_path / "mg", tp=2, pp=2)
    got_arch, meta = read_meta(tmp_path / "mg")
    assert meta["kind"] == "model" and meta["dtype"] == {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    assert (got_arch.num_layers, got_arch.vocab_size, got_arch.tie_embeddings) == (
        arch.num_layers, arch.vocab_size, arch.tie_embeddings,
    )  # fmt: skip
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", hf_template=hf, max_shard_size="50KB", bucket_bytes=20 << 10)
    back = tmp_path / "back"
    assert (back / "tokenizer_config.json").read_text() == (hf / "tokenizer_config.json").read_text()
    index = json.loads((back / "model.safetensors.index.json").read_text())
    for f in set(index["weight_map"].values()):
        one = load_file(back / f)
        assert len(one) == 1 or sum(t.numel() * t.element_size() for t in one.values()) <= 50 * 1024
    orig, new = tensors(hf), tensors(back)
    if arch.tie_embeddings:
        orig.pop("lm_head.weight", None)
    assert sorted(new) == sorted(orig)
    for k, v in orig.items():
        assert v.dtype == new[k].dtype and torch.equal(v, new[k]), k
    # transformers loads the result as is, with the same weights (and the tied head).
    a = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype).state_dict()
    b = AutoModelForCausalLM.from_pretrained(back, dtype=dtype).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_dtype_override_upcasts(tmp_path):
    hf = save_hf(LLAMA_TINY, tmp_path / "hf", dtype=torch.bfloat16)
    hf_to_megatron(hf, tmp_path / "mg", dtype="fp32")
    megatron_to_hf(tmp_path / "mg", tmp_path / "back")
    orig, new = tensors(hf), tensors(tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["torch_dtype"] == "float32"
    for k, v in new.items():
        assert v.dtype == torch.float32 and torch.equal(v, orig[k].float()), k


@pytest.fixture(scope="module")
def qwen_hf(tmp_path_factory):
    return save_hf(QWEN2_TINY, tmp_path_factory.mktemp("qwen") / "hf", max_shard_size="60KB")


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_tensor(hf: Path, name: str, value: torch.Tensor | None, new_name: str | None = None) -> None:
    """Replace (or drop, or add beside) one tensor in its shard, keeping the index consistent."""
    index_path = hf / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"][name]
    data = load_file(hf / shard)
    if new_name is not None:
        data[new_name] = value
        index["weight_map"][new_name] = shard
    elif value is None:
        del data[name], index["weight_map"][name]
    else:
        data[name] = value
    save_file(data, hf / shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case", ["config_mismatch", "missing", "extra", "wrong_shape", "non_empty_out", "bad_tp", "no_config"]
)
def test_bad_hf_inputs_are_refused(tmp_path, qwen_hf, case):
    hf = _copy(qwen_hf, tmp_path / "hf")
    out = tmp_path / "out"
    args = ["--hf", str(hf), "--out", str(out)]
    v = "model.layers.1.self_attn.v_proj.weight"
    if case == "config_mismatch":
        args += ["--model-config", "tiny"]
        needles = ["num_layers mismatch", "2", "4"]
    elif case == "missing":
        _edit_tensor(hf, "model.layers.2.mlp.up_proj.weight", None)
        needles = ["missing tensors: model.layers.2.mlp.up_proj.weight"]
    elif case == "extra":
        _edit_tensor(hf, v, torch.zeros(3), new_name="model.layers.0.self_attn.extra.weight")
        needles = ["unexpected tensors: model.layers.0.self_attn.extra.weight"]
    elif case == "wrong_shape":
        _edit_tensor(hf, v, torch.zeros(16, 64))
        needles = [f"wrong shape: {v} [16, 64] (expected [32, 64])"]
    elif case == "non_empty_out":
        out.mkdir()
        (out / "keep.txt").write_text("precious")
        needles = [str(out), "not empty", "--overwrite"]
    elif case == "bad_tp":
        args += ["--tp", "4"]
        needles = ["tp = 4", "KV groups"]
    else:
        (hf / "config.json").unlink()
        needles = ["no config.json"]
    proc = run_tool("convert_hf_to_megatron.py", *args)
    assert_one_line_error(proc, *needles)
    if case == "non_empty_out":
        assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"
    else:
        assert not out.exists()
    no_leftovers(out)


@pytest.mark.timeout(300)
def test_failure_mid_conversion_leaves_nothing(tmp_path, qwen_hf):
    """A shard whose data is truncated fails while writing: no output directory, no temporary directory."""
    hf = _copy(qwen_hf, tmp_path / "hf")
    last = sorted(hf.glob("*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-100])
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=last.name):
        hf_to_megatron(hf, out)
    assert not out.exists()
    no_leftovers(out)


@pytest.mark.timeout(300)
def test_overwrite_replaces_output(tmp_path, qwen_hf):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    hf_to_megatron(qwen_hf, out, overwrite=True)
    assert not (out / "old.txt").exists() and (out / "dapo_meta.json").is_file()
    no_leftovers(out)


@pytest.mark.timeout(300)
def test_bad_megatron_inputs_are_refused(tmp_path, qwen_hf):
    mg = tmp_path / "mg"
    hf_to_megatron(qwen_hf, mg)
    other = save_hf(LLAMA_TINY, tmp_path / "llama")
    out = tmp_path / "out"
    proc = run_tool("convert_megatron_to_hf.py", "--in", str(mg), "--out", str(out), "--hf-template", str(other))
    assert_one_line_error(proc, "family mismatch", "qwen2", "llama")
    assert not out.exists()
    proc = run_tool("convert_megatron_to_hf.py", "--in", str(other), "--out", str(out))
    assert_one_line_error(proc, str(other), "dapo_meta.json")
    out.mkdir()
    (out / "x").write_text("x")
    proc = run_tool("convert_megatron_to_hf.py", "--in", str(mg), "--out", str(out))
    assert_one_line_error(proc, "not empty")
    assert [p.name for p in out.iterdir()] == ["x"]
    # A checkpoint whose architecture claims more layers than it stores.
    meta = json.loads((mg / "dapo_meta.json").read_text())
    meta["arch"]["num_layers"] = 6
    (mg / "dapo_meta.json").write_text(json.dumps(meta))
    proc = run_tool("convert_megatron_to_hf.py", "--in", str(mg), "--out", str(tmp_path / "out2"))
    assert_one_line_error(proc, "4 layers stored, model has 6")
    assert not (tmp_path / "out2").exists()


def test_parse_size():
    assert parse_size("2GB") == 2 << 30 and parse_size("500MB") == 500 << 20 and parse_size("10KiB") == 10 << 10
    with pytest.raises(ConfigError, match="--max-shard-size"):
        parse_size("lots")
