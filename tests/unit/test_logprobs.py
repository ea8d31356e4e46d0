"""Chunked vocab-parallel logprobs: equal to the unchunked computation, and peak memory flat in sequence length."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO

WORKER = Path(__file__).with_name("logprob_mem_worker.py")


@pytest.fixture(scope="module")
def single_rank():
    from megatron_dapo.actor.dist import init_distributed, teardown
    from megatron_dapo.config.run_config import ParallelConfig

    init_distributed(ParallelConfig())
    yield
    teardown()


def test_chunked_equals_unchunked_and_reference(single_rank):
    from megatron_dapo.actor.logprobs import token_logprobs

    torch.manual_seed(0)
    real_vocab, padded = 250, 256  # the padded rows must not take probability mass
    weight = torch.randn(padded, 32, requires_grad=True)
    hidden = torch.randn(300, 32, requires_grad=True)
    targets = torch.randint(0, real_vocab, (300,))
    logits = hidden @ weight[:real_vocab].t()
    ref_lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    ref_lp.sum().backward()
    ref_grads = hidden.grad.clone(), weight.grad.clone()
    for chunk in (7, 64, 300, 1024):
        hidden.grad = weight.grad = None
        lp, ent = token_logprobs(hidden, weight, targets, real_vocab, chunk_tokens=chunk, with_entropy=True)
        torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
        lp.sum().backward()
        torch.testing.assert_close(hidden.grad, ref_grads[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(weight.grad, ref_grads[1], atol=1e-5, rtol=0)


def _extra_mb(seq_len: int, chunk: int) -> float:
    out = subprocess.run(
        [sys.executable, str(WORKER), str(seq_len), str(chunk)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_mb"]


@pytest.mark.timeout(600)
def test_peak_memory_flat_in_sequence_length():
    # 32k vocab: unchunked fp32 logits are 128 MiB per 1k tokens; with 512-token chunks the extra memory must not grow
    # with the sequence (only the [L] outputs and [L, 64] hidden grow: < 1 MiB per 1k tokens).
    short, long = _extra_mb(2048, 512), _extra_mb(16384, 512)
    unchunked = _extra_mb(4096, 4096)
    print(f"extra peak RSS: chunked 2k={short:.0f} MiB, 16k={long:.0f} MiB; unchunked 4k={unchunked:.0f} MiB")
    assert long - short < 64, (short, long)  # 14k more tokens would cost ~1.8 GiB of logits unchunked
    assert unchunked > 2 * long  # the measurement can tell the difference
