"""The actor's memory model (``megatron_dapo/models/memory.py``) against measurements of the real actor on CPU.

1. The local spec's activations per layer and token, term by term: ``local_activation_bytes_per_token`` equals what
   autograd saves for the backward pass in one layer (counted by ``saved_tensors_hooks``), for GQA, MHA and bf16.
2. The whole prediction: ``actor_memory``'s peak (less the process's own ``BASE_BYTES``) against the peak RSS of a
   real train step above the process's resident size before the actor was built (``actor_mem_worker.py``: the
   kernel's high-water mark, reset before the step, as ``logprob_mem_worker.py`` measures it), at three shapes that
   weigh different terms: per-token activations, attention scores over long rows, a bf16 model.
   Measured (2 cores, torch 2.13, megatron-core 0.16.1): predicted / measured = 0.99, 1.00 and 0.91 (docs/benchmarks.md, "The memory model, measured").
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, repo_pythonpath

WORKER = Path(__file__).with_name("actor_mem_worker.py")
MiB = 2**20
TOLERANCE = 0.25  # |predicted / measured − 1| of the peak
# Qwen2/Llama-shaped, small enough for seconds per step, large enough that activations dwarf the allocator's noise
PROBE = dict(name="probe", family="llama", num_layers=4, hidden_size=256, ffn_hidden_size=704, num_attention_heads=4,
             num_query_groups=2, vocab_size=8192, max_position_embeddings=4096, rope_theta=10000.0, qkv_bias=False,
             tie_embeddings=True)  # fmt: skip


def _worker(spec: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": repo_pythonpath()}
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(spec)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "arch_changes,dtype",
    [({}, "fp32"), ({"num_query_groups": 4}, "fp32"), ({"num_attention_heads": 8, "kv_channels": 32}, "bf16")],
    ids=["gqa-fp32", "mha-fp32", "gqa8-bf16"],
)
def test_local_activations_are_what_autograd_saves(arch_changes, dtype):
    from megatron_dapo.models.arch import ArchConfig
    from megatron_dapo.models.memory import local_activation_bytes_per_token

    arch = {**PROBE, **arch_changes}
    rows, length = 8, 128
    saved = _worker({"arch": arch, "rows": rows, "len": length, "prompt": 16, "dtype": dtype, "saved": True})
    measured = saved["saved_bytes_per_layer_token"]
    counted = local_activation_bytes_per_token(ArchConfig(**arch), length, 4 if dtype == "fp32" else 2)
    assert counted == pytest.approx(measured, rel=0.02), (counted, measured)


SHAPES = [  # (layers, rows, row length, dtype)
    (4, 32, 128, "fp32"),  # per-token terms (norms, attention projections, MLP) dominate
    (4, 2, 2048, "fp32"),  # the attention scores of long rows dominate
    (4, 8, 256, "bf16"),  # a 16-bit model: fp32 master weights, 16-bit activations (bf16 matmuls are slow on a CPU)
]


@pytest.mark.parametrize("layers,rows,length,dtype", SHAPES, ids=[f"{n}L-{b}x{t}-{d}" for n, b, t, d in SHAPES])
def test_predicted_peak_matches_the_measured_train_step(layers, rows, length, dtype):
    from megatron_dapo.models.arch import ArchConfig
    from megatron_dapo.models.memory import BASE_BYTES, actor_memory

    arch = {**PROBE, "num_layers": layers}
    out = _worker({"arch": arch, "rows": rows, "len": length, "prompt": 16, "dtype": dtype})
    assert out["exact"], "the kernel refused to reset the high-water mark (clear_refs): the peak would be sampled"
    m = actor_memory(ArchConfig(**arch), rows * length, length, dtype_bytes=4 if dtype == "fp32" else 2)
    predicted, measured = m.total - m.base, out["peak_mib"] * MiB
    print(f"{layers}L {rows}x{length} {dtype}: predicted {predicted / MiB:.0f} MiB ({m.explain()}), measured "
          f"{measured / MiB:.0f} MiB above a {out['base_mib']:.0f} MiB process")  # fmt: skip
    assert abs(predicted / measured - 1) <= TOLERANCE, (predicted / MiB, measured / MiB, m.explain())
    assert out["base_mib"] * MiB <= BASE_BYTES  # the process's own share of the prediction covers the imports


def test_shared_prompt_rows_bound_the_attention_of_the_budget():
    """With shared prompts a row holds a prompt and its whole group: the budget is sized for that row's attention."""
    from megatron_dapo.actor.micro_batches import micro_batch_budget
    from megatron_dapo.config.run_config import load_config
    from megatron_dapo.models.arch import load_arch

    arch = dataclasses.replace(load_arch("smollm2-135m"), num_layers=2)
    over = ["data.max_prompt_len=256", "rollout.sampling.max_new_tokens=512", "algo.group_size=16",
            "parallel.max_auto_micro_batch_tokens=1000000"]  # fmt: skip
    shared, _ = micro_batch_budget(load_config("demo_cpu", over), arch, "padded", 1)
    alone, _ = micro_batch_budget(load_config("demo_cpu", [*over, "parallel.share_prompts=false"]), arch, "padded", 1)
    assert shared < alone
