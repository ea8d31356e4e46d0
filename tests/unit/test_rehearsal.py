"""`dapo rehearse`: every rank of a GPU recipe's layout built with torch's fake process group on the meta device,
checked against the launch's placement and the memory model; planted faults fail it, naming what is wrong."""

from __future__ import annotations

import json

import pytest

from megatron_dapo.config.run_config import load_config
from megatron_dapo.launch.placement import Placement
from megatron_dapo.models.arch import load_arch
from megatron_dapo.models.memory import GiB, count_params
from megatron_dapo.planning import rehearsal
from megatron_dapo.planning.rehearsal import PHASES, rehearse


def _no_process_group():
    """The rehearsal builds its ranks on a fake process group of its own; an earlier test in this process (a
    checkpoint conversion) may have left a gloo group and megatron-core's groups initialized."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module", autouse=True)
def no_process_group_in_this_module():
    _no_process_group()


@pytest.fixture(autouse=True)
def no_process_group():
    _no_process_group()


@pytest.fixture(scope="module")
def dapo_32b():
    return rehearse(load_config("dapo_32b", []), 16, 8, "dapo_32b")


def test_dapo_32b_every_rank_built_placed_and_counted(dapo_32b):
    r = dapo_32b
    assert r.ok, r.failures
    arch = load_arch("qwen2.5-32b")
    ranks = sorted(rank for c in r.classes for rank in c.ranks)
    assert ranks == list(range(128)) and r.world == 128
    for c in r.classes:  # exact per-rank counts: the stage's own layers, the embedding on 0, norm + output on 1
        assert c.build.params == count_params(arch, 8, 2, c.stage)
        assert 2 * c.build.params <= c.build.param_bytes < 2.001 * c.build.params  # bf16 (the local spec's norms fp32)
        assert {ph.phase for ph in c.phases} == set(PHASES)
    assert {c.build.params for c in r.classes} == {2_048_356_352, 2_048_361_472}
    roles = {(c.stage, c.role): len(c.ranks) for c in r.classes}
    assert roles == {(0, "driver"): 1, (0, "poster"): 15, (0, "sender"): 48, (1, "poster"): 16, (1, "sender"): 48}
    # the sync: every HF tensor once, the whole bf16 model, the embedding a bucket of its own (> bucket_mb)
    assert r.sync.model_bytes == 2 * count_params(arch, 1, 1, 0, arch.vocab_size)
    assert r.sync.largest == 2 * arch.vocab_size * arch.hidden_size and len(r.sync.routes) == 32
    driver = {ph.phase: {t.name: t.rehearsed for t in ph.terms} for ph in r.classes[0].phases}
    assert driver["export"]["export in flight"] >= r.sync.largest  # a bucket (+ the parameter in flight), not the model
    assert driver["export"]["export in flight"] < r.sync.model_bytes / 8
    assert r.sync.gather.driver > r.sync.gather.share > 0  # on the hosts, over gloo: rank 0 receives every token
    text = rehearsal.render(r)
    assert "2,048,356,352" in text and "| startup | rollout | sync | old_logprobs | train | export |" in text
    assert "OK: every rank" in text and "each of the 32 engines keeps up to 512 requests in flight" in text
    startup = {ph.phase: ph for ph in r.classes[0].phases}["startup"]
    assert 70 * GiB < startup.rehearsed < r.usable  # the start-up peak is the tightest phase, and it fits


def test_wrong_rank_order_fails_naming_the_rank(monkeypatch):
    """The launch places engines by its own reading of megatron's rank order; a wrong reading must fail."""
    cfg = load_config("dapo_32b", [])

    def pipeline_fastest(self, rank):
        pp, rest = rank % self.pp, rank // self.pp
        tp, dp = rest % self.tp, rest // self.tp
        return {"tp": tp, "cp": 0, "dp": dp, "pp": pp}

    monkeypatch.setattr(Placement, "coords", pipeline_fastest)
    r = rehearse(cfg, 2, 8, "dapo_32b")
    assert not r.ok and any(f.startswith("rank 1: megatron-core places it at") for f in r.failures), r.failures


def test_planner_count_off_by_one_fails(monkeypatch):
    monkeypatch.setattr(rehearsal, "count_params", lambda *a, **k: count_params(*a, **k) + 1)
    r = rehearse(load_config("dapo_32b", []), 2, 8, "dapo_32b")
    assert any("built 2,048,356,352 parameters, planner 2,048,356,353" in f for f in r.failures), r.failures


def test_memory_model_disagreement_fails_naming_phase_and_term(monkeypatch):
    import megatron_dapo.planning.planner as plan

    real = plan.count_params
    monkeypatch.setattr(plan, "count_params", lambda *a, **k: int(real(*a, **k) * 1.05))
    r = rehearse(load_config("dapo_32b", []), 2, 8, "dapo_32b")
    assert any("train phase, trainer grads: built" in f and "margin 2%" in f for f in r.failures), r.failures


def test_startup_overflow_fails_naming_the_phase():
    """mem_fraction 0.66 (the sbatch's value before the start-up phase was modelled) with FP8 does not fit."""
    r = rehearse(load_config("dapo_32b", ["rollout.mem_fraction=0.66"]), 16, 8, "dapo_32b")
    assert any(f.startswith("memory model: start-up phase:") for f in r.failures)
    assert any("startup phase needs 78.8 GiB > 75.7 GiB usable" in f for f in r.failures), r.failures


def test_cli_qwen3_32b_prints_the_table(capsys):
    assert rehearsal.main(["--recipe", "dapo_qwen3_32b", "--nodes", "16", "--no-step"]) == 0
    out = capsys.readouterr().out
    assert "128 trainer ranks on 16 nodes" in out and "| PP stage 0, driver | ranks [0] |" in out
    assert f"{count_params(load_arch('qwen3-32b'), 8, 2, 1):,}" in out
    # 2 nodes: DP 1, the optimizer states unsharded: training does not fit, exit 1, said in the JSON
    assert rehearsal.main(["--recipe", "dapo_qwen3_32b", "--nodes", "2", "--json", "--no-step"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert not data["ok"] and data["world"] == 16 and {c["stage"] for c in data["classes"]} == {0, 1}
    assert any("train phase needs" in f for f in data["failures"])
    # 24 GPUs: TP8 × PP2 does not divide
    assert rehearsal.main(["--recipe", "dapo_qwen3_32b", "--nodes", "3", "--no-step"]) == 2
    assert "must divide" in capsys.readouterr().err


def test_middle_pipeline_stages_are_compared_with_their_own_model():
    """PP 4: stages 1 and 2 hold neither the embedding nor the output layer; each is compared with its own stage."""
    r = rehearse(load_config("dapo_32b", ["parallel.pp=4"]), 16, 8, "dapo_32b")
    assert not [f for f in r.failures if "margin" in f or "planner" in f], r.failures
    arch = load_arch("qwen2.5-32b")
    params = {c.stage: c.build.params for c in r.classes}
    assert params == {s: count_params(arch, 8, 4, s) for s in range(4)} and params[1] == params[2] < params[3]


def test_dapo_qwen3_30b_a3b_with_expert_parallelism_every_rank_holds_its_experts():
    """The MoE recipe on 2 nodes at EP 2 (PP 2, TP 4, DP 2): each expert-parallel rank built with its own 64 of the 128
    experts per layer, counted as the planner counts them (the experts apart: the distributed optimizer shards them
    over DP·CP/EP), and every phase fits."""
    from megatron_dapo.models.memory import expert_params

    overrides = ["parallel.pp=2", "parallel.ep=2", "rollout.mem_fraction=0.38"]
    r = rehearse(load_config("dapo_qwen3_30b_a3b", overrides), 2, 8, "dapo_qwen3_30b_a3b")
    assert r.ok, r.failures
    arch = load_arch("qwen3-30b-a3b")
    for c in r.classes:
        assert c.build.params == count_params(arch, 4, 2, c.stage, ep=2)
        assert c.build.expert_params == expert_params(arch, 4, 2, c.stage, 2) == 24 * 64 * 3 * 768 * 2048 // 4
        train = {ph.phase: ph for ph in c.phases}["train"]
        optimizer = next(t for t in train.terms if t.name == "trainer optimizer")
        # DP 2, EP 2: dense weights sharded 2 ways, the experts not at all (their expert-DP is 1)
        want = 12 * ((c.build.params - c.build.expert_params) / 2 + c.build.expert_params)
        assert optimizer.rehearsed == pytest.approx(want) and not optimizer.disagrees()


def test_an_expert_count_off_by_one_fails(monkeypatch):
    monkeypatch.setattr(rehearsal, "expert_params", lambda *a, **k: 1)
    cfg = load_config("dapo_qwen3_30b_a3b", ["model.arch=tiny-moe", "parallel.tp=1", "parallel.pp=2", "parallel.ep=2"])
    r = rehearse(cfg, 1, 4, "tiny-moe")
    assert any("expert parameters, planner 1" in f for f in r.failures), r.failures


def test_each_schedules_sync_is_walked_at_the_recipes_rank_count(dapo_32b, monkeypatch):
    """Every schedule's step boundary at 128 ranks: rank 0 and the first rank of stage 1 each meet on the control plane
    (before_sync) before the sync's default-group gather; the stream schedule without its meeting fails, named."""
    from megatron_dapo.loop import control
    from megatron_dapo.loop.stream_schedule import StreamSchedule

    r = dapo_32b
    assert r.ok, r.failures
    assert set(r.control) == {"sync", "partial", "one_step_off", "async", "stream", "stream_updates"}
    for name, ranks in r.control.items():
        assert set(ranks) == {0, 64}
        for events in ranks.values():
            step1 = [e for e in events if "(step 1:" in e]
            meet = step1.index("control: broadcast_object_list (step 1: before_sync)")
            assert meet < step1.index("default: all_gather_object (step 1: sync)"), (name, step1)
    text = rehearsal.render(r)
    assert "control plane, step 1" in text and "  stream_updates, rank 64: (control: broadcast_object_list" in text
    monkeypatch.setattr(StreamSchedule, "before_sync", lambda self: self._interrupt() if control.is_driver() else None)
    r = rehearse(load_config("dapo_32b", []), 16, 8, "dapo_32b")
    assert any(f.startswith("control plane: stream: rank 64 enters") for f in r.failures), r.failures
    assert not any(f.startswith("control plane: sync:") for f in r.failures)


def test_the_lora_recipe_builds_its_adapters_trains_only_them_and_fits_a_quarter_of_the_nodes(capsys):
    """dapo_32b_lora: every rank built with its adapters (the trainable parameters are the planner's lora_params), the
    sync the adapters only, every phase fits on 4 nodes; without LoRA the same layout does not fit."""
    from megatron_dapo.models.memory import lora_params

    assert rehearsal.main(["--recipe", "dapo_32b_lora", "--json", "--no-step"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["world"] == 32 and data["sync"]["adapter_tensors"] == 896
    arch = load_arch("qwen2.5-32b")
    assert data["sync"]["adapter_bytes"] == 2 * lora_params(arch, 64)
    r = rehearse(load_config("dapo_32b_lora"), 4, 8, "dapo_32b_lora", step=False)
    assert {c.build.trainable_params for c in r.classes} == {lora_params(arch, 64, tp=8)}
    full = rehearse(load_config("dapo_32b_lora", ["model.lora.rank=0"]), 4, 8, "full", step=False)
    assert not full.ok and any("train phase needs" in f for f in full.failures), full.failures
