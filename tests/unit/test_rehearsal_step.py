"""`dapo rehearse`'s step: ranks of a GPU layout train once on fake tensors (the real MegatronActor, megatron-core's
DDP, distributed optimizer and pipeline schedule, the bridge's export), their memory measured by torch's MemTracker
and compared with the memory model. A small layout with real shapes (Qwen2.5-0.5B's, 4 layers, TP 2 × PP 2 × DP 2)
at the 32B recipe's lengths runs in seconds; the 32B recipes run in `bench/rehearse_step.py` (minutes). Planted under-counts in the model are
caught by the measured column, not by a number written here."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.config.run_config import load_config
from megatron_dapo.models.arch import load_arch
from megatron_dapo.models.memory import count_params
from megatron_dapo.planning import planner
from megatron_dapo.planning.rank_step import RankStep
from megatron_dapo.planning.rehearsal import STEP_MARGIN, _step_failures, rehearse, render
from tests.helpers import REPO

pytestmark = pytest.mark.timeout(600)
ARCH = str(REPO / "tests/data/rehearsal/qwen2.5-0.5b-4layers.yaml")
# the 32B recipe's lengths (a 2,048-token prompt and a 20,480-token response fill each micro-batch), small shapes
SMALL = [f"model.arch={ARCH}", "parallel.tp=2", "parallel.pp=2", "rollout.sglang_tp=1", "cluster.nodes=1"]


def _rehearse():
    return rehearse(load_config("dapo_32b", SMALL), 1, 8, "small", step=True)


@pytest.fixture(scope="module")
def small():
    return _rehearse()


def _term(cls, phase: str, name: str):
    row = next(ph for ph in cls.phases if ph.phase == phase)
    return next(t for t in row.terms if t.name == name)


def test_each_stage_trains_once_and_its_memory_is_measured(small):
    r = small
    assert r.ok, r.failures
    assert sorted(r.steps) == [0, 4]  # the driver, and the first rank of stage 1
    arch = load_arch(ARCH)
    for rank, st in r.steps.items():
        stage = 0 if rank == 0 else 1
        assert st.params == count_params(arch, 2, 2, stage) and not st.unmapped and not st.unbuilt
        # the resident state read from the live objects: bf16 weights, fp32 grad buffers, the optimizer's shard
        assert st.parts["weights"] == 2 * st.params
        assert 4 * st.params <= st.parts["grads"] < 4.01 * st.params  # DDP pads its buffers
        assert 12 * st.params / 2 <= st.parts["optimizer"] < 12.1 * st.params / 2  # fp32 master + 2 moments, ÷ DP
        assert st.micro_batches == 2 and st.micro_batch_tokens == 22528
        # each phase's peak is above what stays: the update holds activations, the pass and the export their own
        assert st.transient("train") > 0.1 * 2**30 and st.transient("old_logprobs") > 0
        assert st.transient("export") > 0 if rank == 0 else True
    # stage 1 holds the logits (vocabulary 151,936 over TP 2): its logprob pass peaks above stage 0's by more than two
    # fp32 copies of a 2,048-token chunk of them
    assert r.steps[4].transient("old_logprobs") - r.steps[0].transient("old_logprobs") > 2048 * 76032 * 8
    text = render(r)
    assert "step: ranks [0, 4]" in text and "measured by torch's MemTracker" in text and "OK: every rank" in text


def test_every_trainer_term_is_the_measured_one_within_the_margin(small):
    for cls in small.classes:
        for phase, name in [("train", "trainer activations + logits"), ("old_logprobs", "logprob pass"),
                            ("train", "trainer grads"), ("startup", "trainer optimizer")]:  # fmt: skip
            t = _term(cls, phase, name)
            assert t.margin == STEP_MARGIN and t.why.startswith("measured") and not t.disagrees(), (cls.label, t)


def test_planted_activation_under_count_is_caught(monkeypatch):
    """The model's activations halved: the measured update disagrees, naming the phase and the term."""
    real = planner.activation_bytes_per_token
    monkeypatch.setattr(planner, "activation_bytes_per_token", lambda *a, **k: real(*a, **k) / 2)
    r = _rehearse()
    assert any("train phase, trainer activations + logits: measured" in f for f in r.failures), r.failures


def test_planted_logits_under_count_is_caught(monkeypatch):
    """The head's logits left out of the model: stage 1's update and logprob pass disagree with the measured ones."""
    monkeypatch.setattr(planner, "logits_bytes", lambda *a, **k: 0.0)
    monkeypatch.setattr(planner, "forward_pass_bytes", lambda one, *a, **k: one)
    r = _rehearse()
    stage1 = [f for f in r.failures if f.startswith("PP stage 1")]
    assert any("trainer activations + logits" in f for f in stage1), r.failures
    assert any("old_logprobs phase, logprob pass" in f for f in stage1), r.failures
    assert not any("trainer activations + logits" in f for f in r.failures if f.startswith("PP stage 0"))


def test_a_mapping_gap_found_by_the_step_is_a_failure():
    builds = [type("B", (), {"rank": 0, "pp": 0, "params": 10})()]
    ok = RankStep(rank=0, params=10)
    assert _step_failures({0: ok}, builds, None) == []
    bad = RankStep(rank=0, params=12, unmapped=["decoder.layers.0.self_attention.q_layernorm.weight"],
                   unbuilt=["decoder.layers.0.mlp.linear_fc2.weight"])  # fmt: skip
    text = "\n".join(_step_failures({0: bad}, builds, None))
    assert "1 built parameters the bridge does not map, e.g. decoder.layers.0.self_attention.q_layernorm" in text
    assert "the bridge maps 1 parameters megatron-core did not build" in text and "the step built 12" in text


def test_the_te_stand_ins_keep_what_te_keeps_for_backward():
    """Flash attention keeps q, k, v, its output and fp32 softmax statistics (no [s, s] scores); RMSNorm its input
    and fp32 1/rms: counted through autograd's saved-tensor hooks on real tensors."""
    from types import SimpleNamespace

    from megatron_dapo.planning.te_standins import FlashAttentionStandIn, RMSNormStandIn

    def saved_bytes(fn):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(seen.values())

    s, heads, groups, d = 512, 4, 2, 16
    q = torch.randn(s, heads, d, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(s, groups, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    thd = SimpleNamespace(qkv_format="thd")
    attn = FlashAttentionStandIn(None, 1, None, None)
    out = attn(q, k, v, None, packed_seq_params=thd)
    assert out.shape == q.shape
    want = 2 * s * heads * d * 2 + 2 * s * groups * d * 2 + 4 * heads * s  # q and out, k and v, fp32 statistics
    assert saved_bytes(lambda: attn(q, k, v, None, packed_seq_params=thd)) == want  # not 2·heads·s² of scores
    config = SimpleNamespace(params_dtype=torch.bfloat16, sequence_parallel=True)
    norm = RMSNormStandIn(config, 64)
    assert norm.weight.sequence_parallel is True  # its gradient is all-reduced over TP, as TE's
    x = torch.randn(s, 1, 64, dtype=torch.bfloat16, requires_grad=True)
    assert saved_bytes(lambda: norm(x)) == s * 64 * 2 + 64 * 2 + s * 4  # input, weight, fp32 1/rms
