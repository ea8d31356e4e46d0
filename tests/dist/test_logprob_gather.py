"""The actor's per-sequence logprob gather (actor/gather.py) in a 2-rank DP run (torchrun, gloo): no object gather on
the default group (NCCL on GPU), each sequence only on the ranks that use it, the values bit for bit those of the
all-gather-everything scatter it replaces, and the bytes rank 0 receives those ``logprob_gather_bytes`` counts."""

from pathlib import Path

import pytest
import torch

from megatron_dapo.actor.gather import INDEX_BYTES, VALUE_BYTES, logprob_gather_bytes
from tests.helpers import run_torchrun

WORKER = Path(__file__).with_name("logprob_gather_worker.py")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("gather") / "seen"
    run_torchrun(2, WORKER, out, timeout=500)
    return [torch.load(f"{out}.{r}.pt") for r in range(2)]


def test_no_object_gather_on_the_default_group(ranks):
    for seen in ranks:
        assert [g for g in seen["object_gathers"] if g["default_group"]] == []
        # the logprob gathers pickle nothing; the step's few metrics go over a gloo group
        assert [g for g in seen["object_gathers"] if g["phase"] == "compute_logprobs"] == []
        assert all(g["backend"] == "gloo" for g in seen["object_gathers"])


def test_values_bit_identical_to_the_all_gather(ranks):
    for seen in ranks:
        assert seen["checked"] > 0 and seen["mismatched"] == []
        assert seen["every_rank"]  # compute_logprobs: every sequence on every rank


def test_old_logprobs_only_on_the_ranks_that_use_them(ranks):
    zero, one = ranks
    assert one["first_from_forward"] and one["missing"]  # the first mini-batch from its forward, a π_old pass
    assert zero["held"] == list(range(zero["n_seqs"]))  # rank 0: every sequence (the trainer's metrics)
    # rank 1: the later mini-batch's sequences its DP rank trains on, nothing else
    assert one["mine_later"] and one["held"] == one["mine_later"]
    assert len(one["held"]) < one["n_seqs"]


def test_rank0_receives_the_bytes_the_model_counts(ranks):
    msg = INDEX_BYTES + 2 * VALUE_BYTES  # every gather here carries entropies
    calls = ranks[0]["received"]
    assert {c["phase"] for c in calls} == {"compute_logprobs", "train_step"}
    for c in calls:
        assert c["indices"] == list(range(c["n"]))
        assert c["irecv_bytes"] == msg * (c["total_tokens"] - c["own_tokens"]) > 0
        assert logprob_gather_bytes(c["total_tokens"], dp=2).driver >= msg * c["total_tokens"]


def test_gather_bytes_model():
    t = 10_000_000
    b = logprob_gather_bytes(t, dp=8, tp=8, pp=2)
    assert b.device == 0
    assert b.driver == (INDEX_BYTES + 2 * VALUE_BYTES + 4 * VALUE_BYTES) * t  # messages, results, unpacking
    assert b.share < b.driver  # another rank holds its DP rank's share
    assert logprob_gather_bytes(t, dp=8, tp=8, pp=2, with_entropy=False).driver < b.driver
    assert logprob_gather_bytes(2 * t, dp=8, tp=8, pp=2).driver == 2 * b.driver
    # TP and PP change who sends, not the bytes; the replaced all_gather_object held world+1 pickles on every GPU
    assert logprob_gather_bytes(t, dp=8).driver == b.driver
    assert b.replaced_device == (128 + 1) * 24 * t // 8
    assert logprob_gather_bytes(t, dp=1).share == 0
