"""`dapo rehearse`'s step: ranks of a GPU layout train once on fake tensors (the real MegatronActor, megatron-core's
DDP, distributed optimizer and pipeline schedule, the bridge's export), their memory measured by torch's MemTracker
and compared with the memory model. A small layout with real shapes (Qwen2.5-0.5B's, 4 layers, TP 2 × PP 2 × DP 2)
at the 32B recipe's lengths runs in seconds; the 32B recipes run in `bench/rehearse_step.py` (minutes). Planted under-counts in the model are
caught by the measured column, not by a number written here. A mixture of experts the same way: the MoE recipe (full
recompute, routing replay, aux loss) at its lengths on Qwen3-30B-A3B's shapes with 4 layers and 16 experts, the token
dispatch's counts a balanced routing's (planning/moe_standins.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.config.run_config import load_config
from megatron_dapo.models.arch import load_arch
from megatron_dapo.models.memory import count_params, expert_params
from megatron_dapo.planning import planner
from megatron_dapo.planning.rank_step import RankStep
from megatron_dapo.planning.rehearsal import STEP_MARGIN, _step_failures, rehearse, render
from tests.helpers import REPO

pytestmark = pytest.mark.timeout(600)
ARCH = str(REPO / "tests/data/rehearsal/qwen2.5-0.5b-4layers.yaml")
# the 32B recipe's lengths (a 2,048-token prompt and a 20,480-token response fill each micro-batch), small shapes
SMALL = [f"model.arch={ARCH}", "parallel.tp=2", "parallel.pp=2", "rollout.sglang.tp=1", "cluster.nodes=1"]
MOE_ARCH = str(REPO / "tests/data/rehearsal/qwen3-30b-a3b-4layers-16experts.yaml")
# the MoE recipe as it is (full recompute, routing replay, aux loss, 22,528-token micro-batches) on small shapes
SMALL_MOE = [f"model.arch={MOE_ARCH}", "parallel.tp=2", "parallel.pp=2", "rollout.sglang.tp=1", "cluster.nodes=1"]


def _rehearse():
    return rehearse(load_config("dapo_32b", SMALL), 1, 8, "small", step=True)


@pytest.fixture(scope="module")
def small():
    return _rehearse()


def _remodelled_dense(monkeypatch, steps):
    """The dense rehearsal again with the steps it measured (only the memory model's side changes)."""
    from megatron_dapo.planning import rank_step

    monkeypatch.setattr(rank_step, "run_steps", lambda *a, **k: steps)
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


def test_planted_activation_under_count_is_caught(monkeypatch, small):
    """The model's activations halved: the measured update disagrees, naming the phase and the term."""
    real = planner.activation_bytes_per_token
    monkeypatch.setattr(planner, "activation_bytes_per_token", lambda *a, **k: real(*a, **k) / 2)
    r = _remodelled_dense(monkeypatch, small.steps)
    assert any("train phase, trainer activations + logits: measured" in f for f in r.failures), r.failures


def test_planted_logits_under_count_is_caught(monkeypatch, small):
    """The head's logits left out of the model: stage 1's update and logprob pass disagree with the measured ones."""
    monkeypatch.setattr(planner, "logits_bytes", lambda *a, **k: 0.0)
    monkeypatch.setattr(planner, "forward_pass_bytes", lambda one, *a, **k: one)
    r = _remodelled_dense(monkeypatch, small.steps)
    stage1 = [f for f in r.failures if f.startswith("PP stage 1")]
    assert any("trainer activations + logits" in f for f in stage1), r.failures
    assert any("old_logprobs phase, logprob pass" in f for f in stage1), r.failures
    assert not any("trainer activations + logits" in f for f in r.failures if f.startswith("PP stage 0"))


@pytest.fixture(scope="module")
def small_moe():
    return rehearse(load_config("dapo_qwen3_30b_a3b", SMALL_MOE), 1, 8, "small-moe", step=True)


def _remodelled(monkeypatch, steps):
    """The MoE rehearsal again with the steps it measured (only the memory model's side changes)."""
    from megatron_dapo.planning import rank_step

    monkeypatch.setattr(rank_step, "run_steps", lambda *a, **k: steps)
    return rehearse(load_config("dapo_qwen3_30b_a3b", SMALL_MOE), 1, 8, "small-moe", step=True)


def test_moe_step_trains_each_stage_with_its_experts(small_moe):
    r = small_moe
    assert r.ok, r.failures
    assert sorted(r.steps) == [0, 4]
    arch = load_arch(MOE_ARCH)
    for rank, st in r.steps.items():
        stage = 0 if rank == 0 else 1
        assert st.params == count_params(arch, 2, 2, stage) and not st.unmapped and not st.unbuilt
        # 2 layers × 16 experts × SwiGLU (3 × 768 × 2048) over expert TP 2, all on this rank (EP 1)
        assert st.expert_params == expert_params(arch, 2, 2, stage) == 2 * 16 * 3 * 768 * 2048 // 2
        assert st.parts["weights"] == 2 * st.params
        assert 4 * st.params <= st.parts["grads"] < 4.01 * st.params  # dense and expert grad buffers
        # DP 2 and, with EP 1, expert-DP 2: dense weights and experts alike sharded two ways
        assert 12 * st.params / 2 <= st.parts["optimizer"] < 12.1 * st.params / 2
        assert st.micro_batches == 2 and st.micro_batch_tokens == 22528
        # a recomputed MoE layer's combine holds its routed copies (22,528 tokens × 8 × 2,048 × 2 B = 704 MiB a copy)
        assert st.transient("train") > 4 * 22528 * 8 * 2048 * 2 and st.transient("old_logprobs") > 0
    assert r.steps[0].exported_tensors > 0
    assert "OK: every rank" in render(r)


def test_moe_trainer_terms_are_the_measured_ones_within_the_margin(small_moe):
    for cls in small_moe.classes:
        for phase, name in [("train", "trainer activations + logits"), ("old_logprobs", "logprob pass"),
                            ("train", "trainer grads"), ("startup", "trainer optimizer")]:  # fmt: skip
            t = _term(cls, phase, name)
            assert t.margin == STEP_MARGIN and t.why.startswith("measured") and not t.disagrees(), (cls.label, t)


def test_planted_moe_activation_under_count_is_caught(monkeypatch, small_moe):
    """An MoE layer's own activations (router, experts' input and intermediates) left out: under full recompute they
    are the recomputed layer's, and both stages' measured update disagrees."""
    monkeypatch.setattr(planner, "moe_layer_activation_delta", lambda *a, **k: 0.0)
    r = _remodelled(monkeypatch, small_moe.steps)
    for stage in (0, 1):
        assert any(f.startswith(f"PP stage {stage}") and "train phase, trainer activations + logits: measured" in f
                   for f in r.failures), r.failures  # fmt: skip


def test_planted_moe_dispatch_under_count_is_caught(monkeypatch, small_moe):
    """The combine's buffers left out of the running MoE layer: the update and the logprob pass disagree."""
    monkeypatch.setattr(planner, "moe_working_bytes", lambda *a, **k: 0.0)
    monkeypatch.setattr(planner, "moe_forward_bytes", lambda *a, **k: 0.0)
    r = _remodelled(monkeypatch, small_moe.steps)
    assert any("train phase, trainer activations + logits: measured" in f for f in r.failures), r.failures
    assert any("old_logprobs phase, logprob pass: measured" in f for f in r.failures), r.failures


def test_balanced_counts_are_a_dropless_routing():
    """What stands in for the dispatcher's counts: every routed copy counted once, evenly over the experts; with EP the
    rehearsed rank receives PlanOptions.moe_imbalance × its share."""
    from megatron_dapo.planning.moe_standins import IMBALANCE, balanced_counts

    c = balanced_counts(tokens=4096, topk=8, experts=16, tp=2, ep=1)
    assert c.local_per_expert.tolist() == [2048] * 16 and c.input_splits.tolist() == [32768]
    assert c.output_splits_tp.tolist() == [32768, 32768]  # every TP rank's copies, gathered
    assert c.per_local_expert.tolist() == [4096] * 16
    odd = balanced_counts(tokens=1000, topk=3, experts=7, tp=4, ep=1)  # 3,000 copies: 428 or 429 an expert
    assert odd.local_per_expert.sum() == 3000 and sorted(set(odd.local_per_expert.tolist())) == [428, 429]
    assert odd.per_local_expert.sum() == odd.output_splits_tp.sum() == 4 * 3000
    ep = balanced_counts(tokens=4096, topk=8, experts=16, tp=2, ep=2)
    assert IMBALANCE == 1.25 and ep.input_splits.tolist() == [16384, 16384]  # sent: half to each EP rank
    assert ep.output_splits.tolist() == [20480, 20480]  # received from each: 1.25 × the mean
    assert ep.global_per_local_expert.shape == (2, 2, 8) and ep.per_local_expert.sum() == 2 * 2 * 20480


def test_the_permute_stand_in_gives_the_routed_copies_and_keeps_what_masked_select_keeps():
    """On fake tensors megatron-core's permute cannot count the routed copies; the stand-in returns tokens × topk of
    them in its place, and its backward keeps what torch's masked_select keeps (the mask and the input)."""
    from megatron.core.transformer.moe import token_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_dapo.planning.moe_standins import moe_stand_ins

    real = token_dispatcher.permute
    with FakeTensorMode():
        tokens = torch.empty(512, 64, dtype=torch.bfloat16, requires_grad=True)
        routing_map = torch.empty(512, 16, dtype=torch.bool)
        probs = torch.empty(512, 16, requires_grad=True)
        with moe_stand_ins():
            out, permuted_probs, indices = token_dispatcher.permute(tokens, routing_map, probs, num_out_tokens=4096)
        assert token_dispatcher.permute is real
    assert out.shape == (4096, 64) and permuted_probs.shape == (4096,) and indices.shape == (4096,)
    saved = permuted_probs.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in saved] == [(16, 512), (16, 512)] and saved[1].dtype == torch.bool


def test_the_moe_step_replays_the_routes_in_the_recomputed_forward(tmp_path):
    """Full recompute with routing replay: the recomputed MoE layers replay the routes too (megatron-core
    REPLAY_BACKWARD, set by the hook actor/routes.py puts on a stage's output), which torch's MemTracker as it comes
    stopped (rank_step._NoModules). Tiny MoE, stage 0 of TP 2 × PP 2, in a process of its own."""
    import json
    import subprocess
    import sys

    script = tmp_path / "replay.py"
    script.write_text(
        "import collections, json\n"
        "from megatron.core.transformer.moe import router_replay as rr\n"
        "from megatron_dapo.actor.cpu import apply_cpu_shims\n"
        "from megatron_dapo.config.run_config import load_config\n"
        "from megatron_dapo.planning.rank_step import rehearsal_world, run_rank_step\n"
        "seen, real = collections.Counter(), rr.RouterReplay.get_replay_topk\n"
        "def count(self, *a, **k):\n"
        "    seen[str(self.router_replay_action)] += 1\n"
        "    return real(self, *a, **k)\n"
        "rr.RouterReplay.get_replay_topk = count\n"
        "cfg = load_config('dapo_qwen3_30b_a3b', ['model.arch=tiny-moe', 'parallel.tp=2', 'parallel.pp=2',\n"
        "    'data.max_prompt_len=256', 'rollout.sampling.max_new_tokens=4864', 'algo.overlong_cache=512',\n"
        "    'parallel.max_tokens_per_micro_batch=5120', 'cluster.nodes=1'])\n"
        "apply_cpu_shims()\n"
        "with rehearsal_world(0, 8, cfg):\n"
        "    run_rank_step(cfg)\n"
        "print(json.dumps(seen))\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # stage 0 holds one MoE layer (tiny-moe's layer 1 is dense): replayed in every forward and every recomputation
    assert seen.get("RouterReplayAction.REPLAY_BACKWARD", 0) >= 3 and "None" not in seen, seen


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
