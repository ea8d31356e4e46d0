"""The memory / parallelism planner: exact parameter counts, the activation formula, plan choice and the CLI."""

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_dapo.config.run_config import load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import ArchConfig, load_arch, padded_vocab_size
from megatron_dapo.models.memory import GiB, activation_bytes_per_token, count_params, total_params
from megatron_dapo.planning.cli import main
from megatron_dapo.planning.planner import plan
from megatron_dapo.planning.plans import NoFeasiblePlan, choose
from tests.helpers import run_torchrun

WORKER = Path(__file__).resolve().parents[1] / "dist" / "param_count_worker.py"
pytestmark = pytest.mark.timeout(300)


def hf_param_count(a: ArchConfig) -> int:
    """Reference from the HF Qwen2/Llama state-dict shapes (an independent enumeration of tensors)."""
    h, d, f = a.hidden_size, a.head_dim, a.ffn_hidden_size
    shapes = [(a.vocab_size, h), (h,)]  # model.embed_tokens, model.norm
    if not a.tie_embeddings:
        shapes.append((a.vocab_size, h))  # lm_head
    for _ in range(a.num_layers):
        shapes += [(a.num_attention_heads * d, h), (a.num_query_groups * d, h), (a.num_query_groups * d, h)]  # q k v
        if a.qkv_bias:
            shapes += [(a.num_attention_heads * d,), (a.num_query_groups * d,), (a.num_query_groups * d,)]
        shapes += [(h, a.num_attention_heads * d)]  # o_proj
        shapes += [(f, h), (f, h), (h, f)]  # gate, up, down
        shapes += [(h,), (h,)]  # input_layernorm, post_attention_layernorm
    total = 0
    for s in shapes:
        n = 1
        for x in s:
            n *= x
        total += n
    return total


def test_padded_vocab():
    assert padded_vocab_size(152064, 1) == 152064  # already a multiple of 128
    assert padded_vocab_size(152064, 8) == 149 * 1024  # 148.5 x 1024 rounds up
    assert padded_vocab_size(151936, 2) == 594 * 256
    assert padded_vocab_size(32, 1) == 128


@pytest.mark.parametrize("name", ["tiny", "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-32b", "smollm2-135m"])
def test_total_params_match_hf_shapes(name):
    a = load_arch(name)
    assert total_params(a) == hf_param_count(a)


def test_qwen32b_is_32_8b():
    a = load_arch("qwen2.5-32b")
    n = total_params(a)
    # by hand: per layer 2·5120 + (40+16)·128·5120 + (40+16)·128 + 5120·5120 + 3·27648·5120 = 487,605,248
    assert n == 64 * 487_605_248 + 2 * 152064 * 5120 + 5120 == 32_763_876_352
    assert round(n / 1e9, 1) == 32.8


def test_tiny_by_hand():
    a = load_arch("tiny")  # h 128, 2 layers, ffn 512, 4 heads / 2 kv heads (head dim 32), vocab 32 -> 128, tied
    layer = 2 * 128 + (4 + 2 * 2) * 32 * 128 + (4 + 2 * 2) * 32 + 128 * 128 + 2 * 512 * 128 + 128 * 512
    assert count_params(a) == 128 * 128 + 2 * layer + 128 == 509_056
    # PP=2: the last stage holds a copy of the tied embedding as its output layer
    assert count_params(a, pp=2, pp_rank=0) == 128 * 128 + layer
    assert count_params(a, pp=2, pp_rank=1) == layer + 128 + 128 * 128


@pytest.mark.parametrize("tp,pp", [(1, 1), (8, 1), (8, 4), (2, 8), (4, 2)])
def test_sharded_counts_sum_to_whole(tp, pp):
    """Σ over all TP×PP ranks = whole (padded) model + replicated norms + the tied copy on the last stage."""
    for name in ("qwen2.5-32b", "qwen2.5-0.5b"):
        a = load_arch(name)
        if a.num_query_groups % tp or a.num_layers % pp:
            continue
        vocab = padded_vocab_size(a.vocab_size, tp)
        summed = tp * sum(count_params(a, tp, pp, r) for r in range(pp))
        norms = 2 * a.hidden_size * a.num_layers + a.hidden_size
        tied_copy = vocab * a.hidden_size if a.tie_embeddings and pp > 1 else 0
        assert summed == total_params(a, padded_vocab=vocab) + (tp - 1) * norms + tied_copy


def test_count_params_errors():
    a = load_arch("qwen2.5-7b")  # 4 kv heads, 28 layers
    with pytest.raises(ValueError, match="qwen2.5-7b: num_attention_heads = 28 is not divisible by tp = 8"):
        count_params(a, tp=8)
    with pytest.raises(ValueError, match="num_layers = 28 is not divisible by pp = 8"):
        count_params(a, pp=8)


def small_untied() -> ArchConfig:
    return ArchConfig(
        name="small-untied",
        family="llama",
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=160,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=1000,
        qkv_bias=False,
        tie_embeddings=False,
    )


def megatron_counts(tmp_path, archs: list[ArchConfig], tp: int) -> dict:
    """{arch name: {"pp/rank": numel}} from real megatron-core GPTModels (tests/dist/param_count_worker.py)."""
    spec = tmp_path / "archs.json"
    spec.write_text(json.dumps([dataclasses.asdict(a) for a in archs]))
    out = tmp_path / f"counts_tp{tp}.json"
    run_torchrun(tp, WORKER, out, spec, tp, timeout=280)
    return json.loads(out.read_text())


MEGATRON_ARCHS = [load_arch("tiny"), small_untied()]


def test_count_params_matches_megatron_model(tmp_path):
    """The real megatron-core GPTModel (local spec), built stage by stage for PP = 1, 2, 4; tied and untied."""
    counts = megatron_counts(tmp_path, MEGATRON_ARCHS, tp=1)
    assert set(counts) == {a.name for a in MEGATRON_ARCHS}
    for arch in MEGATRON_ARCHS:
        stages = counts[arch.name]
        assert len(stages) == {2: 3, 4: 7}[arch.num_layers]
        for key, n in stages.items():
            pp, rank = map(int, key.split("/"))
            assert count_params(arch, 1, pp, rank) == n, (arch.name, key)


def test_activation_formula_reduces_to_korthikanti():
    """GPT (MHA, FFN 4h, GeLU, dropout): 34·h + 5·a·s bytes per token and layer; flash drops the 5·a·s term."""
    gpt = ArchConfig(hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16, num_query_groups=16)
    s = 2048
    gpt_kw = dict(gated=False, dropout=True, rope_qk=False)
    full = activation_bytes_per_token(gpt, flash=False, attn_seq_len=s, **gpt_kw)
    assert full == 34 * 1024 + 5 * 16 * s
    assert activation_bytes_per_token(gpt, flash=True, **gpt_kw) == 34 * 1024
    assert activation_bytes_per_token(gpt, "full") == 2 * 1024


def test_activation_qwen32b_by_hand():
    a = load_arch("qwen2.5-32b")  # h 5120, q 5120, kv 1024, ffn 27648, SwiGLU, no dropout
    norms, attn, mlp = 4 * 5120, 2 * 5120 + 2 * (5120 + 2048) + 2 * 5120, 2 * 5120 + 4 * 27648 + 2 * 27648
    rope = 2 * (5120 + 1024)  # the rotated q and k beside the fused QKV output v's view keeps (dapo rehearse's step)
    assert activation_bytes_per_token(a, rope_qk=False) == norms + attn + mlp == 231_424
    assert activation_bytes_per_token(a) == norms + attn + mlp + rope
    assert activation_bytes_per_token(a, "selective") == 4 * 5120 + 2 * (5120 + 2048) + 2 * 5120 + rope
    none, sel, full = (activation_bytes_per_token(a, r) for r in ("none", "selective", "full"))
    assert none > sel > full
    with pytest.raises(ValueError, match="recompute = 'some'"):
        activation_bytes_per_token(a, "some")


# Qwen/Qwen2.5-32B by hand, from its published config.json (hidden 5120, 64 layers, 40 heads of 128, 8 KV heads,
# FFN 27648, vocab 152064, q/k/v biases, untied head): a layer is q 5120·5120 + k, v 2·1024·5120 + biases
# 5120 + 2·1024 + o 5120·5120 + gate/up/down 3·27648·5120 + 2 norms of 5120 = 487,605,248; embedding and head
# 152064·5120 = 778,567,680 each. TP8: the vocab padded to 152,576 rows (a multiple of 128·8) -> 97,648,640 per rank;
# a layer (487,605,248 − 10,240 norm weights, which every rank keeps) / 8 + 10,240 = 60,959,616 per rank. PP2 stage
# 0 = embedding + 32 layers; stage 1 = 32 layers + final norm + head (5,120 more).
QWEN32B_HAND = {
    "total": 64 * 487_605_248 + 2 * 778_567_680 + 5120,  # 32,763,876,352 (the Hub shows 32.8B)
    "tp8_pp2_stage0": 32 * 60_959_616 + 97_648_640,  # 2,048,356,352
}


def test_32b_parameter_count_by_hand():
    a = load_arch("qwen2.5-32b")
    assert total_params(a) == QWEN32B_HAND["total"] == 32_763_876_352
    assert count_params(a, 8, 2, 0) == QWEN32B_HAND["tp8_pp2_stage0"] == 2_048_356_352
    assert count_params(a, 8, 2, 1) == 2_048_356_352 + 5120


@pytest.fixture(scope="module")
def plans_32b():
    return plan("qwen2.5-32b", 2048, 20480, 16, 8, 80)


def test_32b_on_16_nodes_fits(plans_32b):
    best = choose(plans_32b)
    assert best.feasible and best is plans_32b[0]
    assert best.memory.total <= 80 * GiB and best.memory_gib <= best.usable_gb
    assert best.tp * best.pp * best.cp * best.dp == 128
    assert best.micro_batch_tokens >= 2048 + 20480
    # the parameter terms of the TP8 PP2 layouts, from hand counts of the published shapes (QWEN32B_HAND)
    tp8pp2 = [p for p in plans_32b if (p.tp, p.pp, p.cp, p.dp) == (8, 2, 1, 8) and p.distributed_optimizer]
    assert tp8pp2
    for p in tp8pp2:
        assert p.memory.stage == 0 and p.memory.params == QWEN32B_HAND["tp8_pp2_stage0"]  # the worst stage
        assert p.memory.weights == 4_096_712_704 and p.memory.grads == 8_193_425_408  # bf16, fp32 main grads
        assert p.memory.optimizer == pytest.approx(3_072_534_528)  # fp32 master + 2 moments = 12 B, / DP 8
    text = best.explain()
    for word in ("weights", "gradients", "optimizer", "activations", "logits", "overhead", "total", "fits"):
        assert word in text
    assert f"parallel.tp={best.tp}" in best.overrides()
    # every feasible plan fits, every infeasible one says why
    assert all(p.memory.total <= p.usable_gb * GiB for p in plans_32b if p.feasible)
    assert all(p.reasons for p in plans_32b if not p.feasible)
    times = [p.step_time_s for p in plans_32b if p.feasible]
    assert times[0] <= min(times) * 1.01


def test_memory_monotone_in_recompute_and_distributed_optimizer(plans_32b):
    """Monotonicity: less recompute or a non-distributed optimizer never needs less memory."""
    by_key = {
        (p.tp, p.pp, p.cp, p.micro_batch_tokens, p.recompute, p.distributed_optimizer, p.fp8): p for p in plans_32b
    }
    for (tp, pp, cp, mb, rec, dist, fp8), p in by_key.items():
        if rec == "none":
            assert p.memory.activations >= by_key[(tp, pp, cp, mb, "selective", dist, fp8)].memory.activations
            assert by_key[(tp, pp, cp, mb, "selective", dist, fp8)].memory.activations >= (
                by_key[(tp, pp, cp, mb, "full", dist, fp8)].memory.activations
            )
        if dist and (p.dp * p.cp) > 1:
            assert p.memory.optimizer < by_key[(tp, pp, cp, mb, rec, False, fp8)].memory.optimizer


def test_too_small_cluster_has_no_plan():
    plans = plan("qwen2.5-32b", 2048, 20480, 1, 8, 24)
    assert plans and not any(p.feasible for p in plans)
    with pytest.raises(NoFeasiblePlan, match=r"no plan fits 8 GPUs × 24 GiB for qwen2.5-32b.*training needs"):
        choose(plans)


def test_more_memory_never_fewer_plans():
    counts = [sum(p.feasible for p in plan("qwen2.5-7b", 1024, 8192, 1, 8, mem)) for mem in (40, 80, 141)]
    assert counts == sorted(counts) and counts[-1] > 0


def test_small_model_prefers_no_model_parallelism():
    best = choose(plan("qwen2.5-0.5b", 512, 1024, 1, 8, 80, fp8_options=(False,)))
    assert (best.tp, best.pp, best.cp, best.dp) == (1, 1, 1, 8)


def test_disaggregated_trains_on_the_other_nodes():
    plans = plan("qwen2.5-32b", 2048, 20480, 16, 8, 80, colocated=False, rollout_nodes=6)
    best = choose(plans)
    assert best.train_gpus == 80 and best.rollout is not None and not best.rollout.colocated
    assert best.memory.rollout == 0


def test_plan_input_errors():
    with pytest.raises(ConfigError, match="max_prompt = 0"):
        plan("qwen2.5-7b", 0, 100, 1, 8, 80)
    with pytest.raises(ConfigError, match="unexpected keyword argument 'colocate'"):
        plan("qwen2.5-7b", 100, 100, 1, 8, 80, colocate=True)
    with pytest.raises(ConfigError, match="rollout_nodes = 2"):
        plan("qwen2.5-7b", 100, 100, 2, 8, 80, colocated=False, rollout_nodes=2)
    with pytest.raises(ConfigError, match="unknown model config 'nope'"):
        plan("nope", 100, 100, 1, 8, 80)


def test_cli(capsys):
    args = ["--model", "qwen2.5-32b", "--max-prompt", "2048", "--max-response", "20480", "--gpus-per-node", "8"]
    assert main(args + ["--nodes", "16", "--gpu-mem", "80", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "chosen plan" in out and "config overrides: parallel.tp=" in out
    assert main(args + ["--nodes", "16", "--gpu-mem", "80", "--json", "--fp8", "off"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"]["fp8"] is False and data["chosen"]["memory_total_gib"] <= 80
    assert all(not p["fp8"] for p in data["feasible"])
    assert main(args + ["--nodes", "1", "--gpu-mem", "24"]) == 1
    assert "no feasible plan" in capsys.readouterr().out
    assert main(args + ["--nodes", "0", "--gpu-mem", "24"]) == 2
    assert "nodes = 0" in capsys.readouterr().out


def test_layout_phases_term_by_term():
    """A chosen layout (dapo_32b on 16 nodes): the rollout phase holds the trainer's weights (grads and optimizer on
    the host) + SGLang's own terms (mem_fraction of the memory free when it starts, and outside it); the train phase
    the trainer's peak + a released engine; `explain` shows both."""
    from megatron_dapo.engines.sglang.memory import CUDA_CONTEXT_BYTES
    from megatron_dapo.models.gpus import gpu_total_gib
    from megatron_dapo.planning.planner import evaluate_layout

    p = evaluate_layout("qwen2.5-32b", 2048, 20480, 16, 8, 80, tp=8, pp=2, cp=1, micro_batch_tokens=22528,
                        engine_tp=4, rollout_mem_fraction=0.60)  # fmt: skip
    train, rollout, startup = p.phases
    assert (train.phase, rollout.phase, startup.phase) == ("train", "rollout", "startup") and p.feasible
    t, r = dict((k, v) for k, v, _ in train.rows), dict((k, v) for k, v, _ in rollout.rows)
    assert r["trainer grads"] == r["trainer optimizer"] == 0  # the heavier stage's weights stay
    assert r["trainer weights"] == pytest.approx(t["trainer weights"], rel=1e-4)
    free_at_start = gpu_total_gib(80) * GiB - CUDA_CONTEXT_BYTES  # an "80 GB" H100: 79.65 GiB
    assert r["SGLang weights"] + r["SGLang KV cache"] == pytest.approx(0.60 * free_at_start, rel=1e-3)
    assert r["SGLang weights"] == pytest.approx(2 * total_params(load_arch("qwen2.5-32b")) / 4)
    assert r["SGLang CUDA graphs"] > 0 and r["SGLang activations"] > 0  # outside mem_fraction
    assert t["SGLang (released)"] == 2 * GiB and train.total == pytest.approx(p.memory.total)
    assert train.total < p.usable_gb * GiB and rollout.total < p.usable_gb * GiB
    text = p.explain()
    assert "rollout phase, per GPU (GiB):" in text and "offloaded to the host" in text and "train phase" in text
    # without the distributed optimizer, keeping the train state on the GPU during rollout no longer fits
    kept = evaluate_layout("qwen2.5-32b", 2048, 20480, 16, 8, 80, tp=8, pp=2, cp=1, micro_batch_tokens=22528,
                           engine_tp=4, rollout_mem_fraction=0.60, offload_train_state=False,
                           distributed_optimizer=False)  # fmt: skip
    assert not kept.phases[1].fits and any(reason.startswith("rollout phase:") for reason in kept.reasons)


def test_startup_peak_is_modelled_and_refused():
    """Before the engines first release, a colocated GPU holds the trainer's whole resident state (weights + FP8 cache,
    the DDP grad buffers, the optimizer states a resumed run loaded) beside SGLang's whole mem_fraction and what it
    holds outside it (CUDA graphs, request table, runtime). The 32B layout with FP8 at mem_fraction 0.66 does not fit
    this phase (77.7 of 76 GiB was the issue's finding); the shipped mem_fraction fits all three."""
    from megatron_dapo.engines.sglang.memory import CUDA_CONTEXT_BYTES
    from megatron_dapo.models.gpus import gpu_total_gib
    from megatron_dapo.planning.planner import evaluate_layout

    def layout(fraction):
        return evaluate_layout("qwen2.5-32b", 2048, 20480, 16, 8, 80, tp=8, pp=2, cp=1, micro_batch_tokens=22528,
                               engine_tp=4, rollout_mem_fraction=fraction, fp8=True)  # fmt: skip

    p = layout(0.66)
    train, rollout, startup = p.phases
    assert train.fits and not startup.fits and not p.feasible
    terms = {k: v for k, v, _ in startup.rows}
    assert terms["trainer grads"] > 0 and terms["trainer optimizer"] > 0 and terms["trainer weights"] > 0
    free_at_start = gpu_total_gib(80) * GiB - CUDA_CONTEXT_BYTES
    assert terms["SGLang weights + KV"] == pytest.approx(0.66 * free_at_start, rel=1e-3)
    assert terms["SGLang CUDA graphs"] > 0
    assert startup.total == pytest.approx(sum(terms.values()))
    assert any(reason.startswith("start-up phase:") for reason in p.reasons)
    shipped = load_config("dapo_32b", []).rollout.mem_fraction
    assert all(ph.fits for ph in layout(shipped).phases), [ph.explain() for ph in layout(shipped).phases]
    # unset, the share an engine gets is what the trainer leaves at start-up: all three phases fit
    chosen = evaluate_layout("qwen2.5-32b", 2048, 20480, 16, 8, 80, tp=8, pp=2, cp=1, micro_batch_tokens=22528,
                             engine_tp=4, fp8=True)  # fmt: skip
    assert chosen.feasible and all(ph.fits for ph in chosen.phases)


def test_moe_layouts_fit_where_the_recipes_say_and_the_experts_are_sharded_over_expert_dp():
    """Qwen3-30B-A3B fits 2x8 and 4x8 H100 (dapo_qwen3_30b_a3b); Qwen3-235B-A22B at 22k tokens fits 32x8 with the
    engines on 8 nodes of their own, not 16x8 (the trainer alone needs more than 76 GiB per GPU there)."""
    from megatron_dapo.models.memory import expert_params
    from megatron_dapo.planning.planner import evaluate_layout

    for nodes in (2, 4):
        best = choose(plan("qwen3-30b-a3b", 2048, 20480, nodes, 8, 80))
        assert best.cp == 1 and best.memory_gib < 76  # routing replay runs at CP 1 only: no plan with CP > 1
    assert all(p.cp == 1 for p in plan("qwen3-30b-a3b", 2048, 20480, 2, 8, 80))
    assert any(p.cp > 1 for p in plan("qwen3-30b-a3b", 2048, 20480, 2, 8, 80, routing_replay=False))
    big = choose(plan("qwen3-235b-a22b", 2048, 20480, 32, 8, 80, colocated=False, rollout_nodes=8,
                      rollout_mem_fraction=0.9))  # fmt: skip
    assert big.ep > 1 and big.rollout.engine_tp == 8 and big.memory_gib < 76
    with pytest.raises(NoFeasiblePlan):
        choose(plan("qwen3-235b-a22b", 2048, 20480, 16, 8, 80, colocated=False, rollout_mem_fraction=0.9))
    # EP 2 at DP 2: the dense weights' Adam states over DP, the experts' over DP / EP = 1
    layout = evaluate_layout("qwen3-30b-a3b", 2048, 20480, 2, 8, 80, tp=4, pp=2, cp=1, micro_batch_tokens=22528,
                             recompute="full", ep=2)  # fmt: skip
    m = layout.stages[0]
    assert m.expert_params == expert_params(load_arch("qwen3-30b-a3b"), 4, 2, 0, 2) > 0
    assert m.optimizer == pytest.approx(12 * ((m.params - m.expert_params) / 2 + m.expert_params))
    assert "parallel.ep=2" in layout.overrides() and "EP2" in layout.label()
    with pytest.raises(ConfigError, match="parallel.ep = 3: must divide DP × CP = 2"):
        evaluate_layout("qwen3-30b-a3b", 2048, 20480, 2, 8, 80, tp=4, pp=2, cp=1, micro_batch_tokens=22528, ep=3)


def test_lora_trains_only_the_adapters_and_fits_the_32b_job_on_fewer_nodes():
    """LoRA (model.lora): the frozen base keeps its weights only; grads and Adam states are the adapters'
    (``memory.lora_params``, checked against the real actor in tests/dist/test_lora_dist.py). The 32B job at 20k
    tokens then fits one node, where full fine-tuning needs two."""
    from megatron_dapo.models.memory import lora_params
    from megatron_dapo.planning.planner import evaluate_layout, plan

    kw = dict(batch_prompts=512, group_size=16, mini_batch_prompts=32)
    lay = dict(tp=8, pp=1, cp=1, micro_batch_tokens=22528, recompute="full")
    full = evaluate_layout("qwen2.5-32b", 2048, 20480, 1, 8, 80.0, **lay, **kw)
    lora = evaluate_layout("qwen2.5-32b", 2048, 20480, 1, 8, 80.0, **lay, lora_rank=64, **kw)
    adapters = lora_params(load_arch("qwen2.5-32b"), 64, tp=8)
    assert lora.memory.lora_params == adapters > 0
    assert lora.memory.grads == 4 * adapters and lora.memory.optimizer == 12 * adapters  # DP 1: nothing to shard
    assert lora.memory.weights == 2 * (full.memory.params + adapters)
    assert full.memory.grads == 4 * full.memory.params and not full.feasible and lora.feasible
    assert lora.step_time_s < full.step_time_s  # no weight gradients for the base, adapters' grads to reduce

    def smallest(**extra) -> int:
        return next(n for n in (1, 2, 4, 8) if any(p.feasible for p in plan("qwen2.5-32b", 2048, 20480, n, 8, 80.0,
                                                                              **kw, **extra)))  # fmt: skip

    assert smallest(lora_rank=64) == 1 and smallest() == 2
