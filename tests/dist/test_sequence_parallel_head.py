"""The sequence-parallel logits head: our side of megatron's output-layer gather, on TP = 2 with gloo.

Megatron's sequence parallelism needs Transformer Engine (GPU) for the model itself, but the head's contract — gather
the sequence shards, vocab-parallel log-softmax, and in backward a reduce-scatter that sums the vocabulary shards'
partial gradients exactly once — is checked here against a plain single-process computation."""

from pathlib import Path

import pytest
import torch

from tests.helpers import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def test_sequence_parallel_head_equals_the_unsharded_computation(tmp_path):
    out = tmp_path / "sp.pt"
    run_torchrun(2, Path(__file__).with_name("sp_head_worker.py"), out)
    r = torch.load(out)
    torch.testing.assert_close(r["sp"]["lp"], r["ref_lp"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r["sp"]["h"], r["ref_h"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r["sp"]["w"][:40], r["ref_w"][:40], rtol=1e-5, atol=1e-5)
    assert r["sp"]["w"][40:].abs().max() == 0  # the padded vocabulary gets no gradient
    # the planted fault, reducing the hidden-state gradient a second time, is seen: TP (= 2) times too large
    torch.testing.assert_close(r["planted"]["h"], 2 * r["ref_h"], rtol=1e-5, atol=1e-5)
