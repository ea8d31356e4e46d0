"""``save_hf_checkpoint`` streams: bounded safetensors shards written bucket by bucket, peak memory about one bucket
(not the model), loadable by transformers tensor for tensor; ``export_plan`` predicts it without a model.

The model is the canonical parameter dict the export reads (``local_parameters`` stubbed), so no megatron model or
process group is needed; the distributed paths are covered by tests/dist (rollout_sync_worker, bridge_worker)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo.bridge import export
from megatron_dapo.bridge.convert import read_st_header
from megatron_dapo.models.arch import ArchConfig, load_arch
from megatron_dapo.models.registry import table_for
from tests.helpers import REPO, make_char_hf_tokenizer, repo_pythonpath

WORKER = Path(__file__).with_name("export_mem_worker.py")
SMALL = ArchConfig(name="s", num_layers=3, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                   num_query_groups=2, vocab_size=100, tie_embeddings=False)  # fmt: skip


def fake_model(monkeypatch, arch: ArchConfig, dtype=torch.float32, seed=0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    local = {p.megatron: torch.randn(p.shape(), generator=gen).to(dtype) for p in table_for(arch).params(arch)}
    monkeypatch.setattr(export, "local_parameters", lambda chunks, a: local)
    return local


def written(out: Path) -> dict[str, list[str]]:
    """Tensor names per safetensors file, read from the headers."""
    return {f.name: list(read_st_header(f)) for f in sorted(out.glob("*.safetensors"))}


def test_peak_memory_is_a_bucket_not_the_model(tmp_path):
    arch = {"name": "m", "num_layers": 12, "hidden_size": 1024, "ffn_hidden_size": 2816, "num_attention_heads": 16,
            "num_query_groups": 4, "vocab_size": 16384, "tie_embeddings": True}  # fmt: skip
    spec = {"arch": arch, "dtype": "fp32", "bucket_bytes": 32 << 20, "max_shard_size": 128 << 20}
    # a fixed mmap threshold: glibc hands freed tensors back at once (the default raises it as blocks are freed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo_pythonpath(), "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(spec), str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    plan = export.export_plan(ArchConfig(**arch), dtype="fp32", bucket_bytes=32 << 20, max_shard_size=128 << 20)
    extra = r["peak"] - r["base"]
    print(f"model {r['model'] >> 20} MiB, export peak +{extra >> 20} MiB, planned <= {plan.rank0_device_bytes >> 20} "
          f"MiB, {plan.shards} shards")  # fmt: skip
    assert plan.total_bytes == r["model"]  # tied: the parameters are exactly the HF tensors
    assert plan.shards == len(written(tmp_path / "hf")) > 1
    assert extra < r["model"] / 3, r  # the old export held a copy of every tensor (and save_file another)
    assert extra <= plan.rank0_device_bytes + (16 << 20), r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_export_round_trips_through_transformers(tmp_path, monkeypatch, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = fake_model(monkeypatch, SMALL, dtype)
    tok = AutoTokenizer.from_pretrained(make_char_hf_tokenizer(tmp_path / "tok"))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"stale")  # an earlier export's file does not survive
    export.save_hf_checkpoint([], SMALL, out, tok, bucket_bytes=20_000, max_shard_size=60_000)
    files = written(out)
    assert len(files) > 2 and "model.safetensors" not in files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(n for names in files.values() for n in names)
    assert all(name in files[f] for name, f in index["weight_map"].items())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    want = table_for(SMALL).megatron_to_hf(local, SMALL)
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == dtype and torch.equal(got[k], v) for k, v in want.items())
    assert AutoTokenizer.from_pretrained(out).encode("1+2") == tok.encode("1+2")
    assert not list(tmp_path.glob(".hf.*"))  # the staging directory was renamed into place


def test_a_model_that_fits_one_shard_is_one_model_safetensors(tmp_path, monkeypatch):
    local = fake_model(monkeypatch, SMALL)
    export.save_hf_checkpoint([], SMALL, tmp_path / "hf")
    assert list(written(tmp_path / "hf")) == ["model.safetensors"]
    assert not (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert len(written(tmp_path / "hf")["model.safetensors"]) == len(table_for(SMALL).megatron_to_hf(local, SMALL))


def test_plan_matches_the_export(tmp_path, monkeypatch):
    fake_model(monkeypatch, SMALL)
    buckets = [sum(t.numel() * t.element_size() for _, t in b) for b in export.export_hf_tensors([], SMALL, 20_000)]
    export.save_hf_checkpoint([], SMALL, tmp_path / "hf", bucket_bytes=20_000, max_shard_size=60_000)
    headers = {f: read_st_header(tmp_path / "hf" / f) for f in written(tmp_path / "hf")}
    plan = export.export_plan(SMALL, dtype=torch.float32, bucket_bytes=20_000, max_shard_size=60_000)
    assert (plan.buckets, plan.max_bucket_bytes) == (len(buckets), max(buckets))
    assert plan.shards == len(headers)
    assert plan.max_shard_bytes == max(sum(e.nbytes for e in h.values()) for h in headers.values())
    assert plan.tensors == sum(len(h) for h in headers.values())
    assert plan.total_bytes == sum(e.nbytes for h in headers.values() for e in h.values())


@pytest.mark.parametrize("name", ["qwen2.5-32b", "qwen3-32b"])
def test_plan_at_32b_holds_a_bucket_not_the_model(name):
    arch = load_arch(name)
    plan = export.export_plan(arch, tp=8, pp=2, dtype="bf16", bucket_bytes=512 << 20, max_shard_size="2GB")
    total = sum(2 * int(torch.Size(s).numel()) for s in table_for(arch).hf_shapes(arch).values())
    assert plan.total_bytes == total > 60 << 30
    assert plan.shards >= total / (2 << 30) and plan.max_shard_bytes <= 2 << 30
    assert plan.buckets >= total / (512 << 20)
    assert plan.rank0_device_bytes < total / 8 and plan.rank0_host_bytes == plan.largest_tensor_bytes
    assert "GiB" in plan.describe()
    print(plan.describe())
