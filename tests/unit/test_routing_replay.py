"""Rollout routing replay (R3) takes effect. An HF engine whose routers are perturbed (so it routes differently from the
trainer) generates samples with their routes; they travel through the groups and sequences into the actor, and the
routers of the actor's own forward (captured by hooks) use exactly the engine's experts with replay on, and other
experts with it off. A sample without routes while replay is on is an error naming the key."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.algo.batch import group_from_samples, to_sequences
from megatron_dapo.config.run_config import load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.engines.sglang.routes import RouteLayout
from megatron_dapo.types import RolloutError, SamplingParams, TokenizerInfo
from tests.helpers import fresh_actors

PROMPTS = [[3, 4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15, 16, 17]]


def config(replay: bool, *extra: str):
    return load_config(
        "demo_cpu",
        [
            "model.arch=tiny-moe",
            f"rollout.routing_replay={str(replay).lower()}",
            "train.batch_prompts=3",
            "train.mini_batch_prompts=3",
            "algo.group_size=2",
            "train.warmup_steps=0",
            "parallel.share_prompts=false",  # one row per sequence
            "data.max_prompt_len=8",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def make_actor():
    yield from fresh_actors(config)  # make_actor(replay, *extra)


def engine_sequences(actor, perturb: float = 0.5):
    """Samples of an HF engine holding the actor's weights but perturbed routers, through groups into sequences."""
    from megatron_dapo.bridge.export import export_hf_tensors
    from megatron_dapo.engines.hf import HFEngine

    engine = HFEngine(actor.arch, TokenizerInfo(eos_token_ids=(2,), pad_token_id=0), return_routes=True, seed=1)
    engine.update_weights(export_hf_tensors(actor.model, actor.arch), version=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in engine._routers:
            router.weight.add_(perturb * torch.randn(router.weight.shape, generator=g))
    samples = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, seed=3), n=2)
    groups = []
    for k, p in enumerate(PROMPTS):
        mine = samples[2 * k : 2 * k + 2]
        groups.append(group_from_samples(p, mine, [{"score": 1.0, "acc": True}, {"score": -1.0, "acc": False}], "t"))
    seqs, _ = to_sequences(groups, actor.cfg)
    return seqs


def used_routes(actor, seqs) -> float:
    """The fraction of (token, MoE layer) whose experts in the actor's forward equal the engine's routes."""
    model = actor.model[0].module
    rows, maps = [], {}
    hooks = [
        model.embedding.register_forward_hook(
            lambda _m, args, kwargs, _o: rows.append((args[0] if args else kwargs["input_ids"]).clone()),
            with_kwargs=True,
        )
    ]
    routers = [(n, m) for n, m in model.named_modules() if n.endswith("mlp.router")]
    for k, (_, router) in enumerate(routers):
        hooks.append(router.register_forward_hook(lambda _m, _i, out, k=k: maps.setdefault(k, []).append(out[1])))
    try:
        actor.compute_logprobs(seqs)
    finally:
        for h in hooks:
            h.remove()
    equal = total = 0
    for call, tokens in enumerate(rows):  # a micro-batch [B, S]: its routers see token (b, t) at row t·B + b
        B = tokens.shape[0]  # noqa: N806
        for b in range(B):
            s = next(s for s in seqs if torch.equal(tokens[b, : s.tokens.numel()], s.tokens))
            n = s.tokens.numel() - 1  # routed tokens
            for k in range(len(routers)):
                chosen = maps[k][call][b::B][:n].nonzero()[:, 1].reshape(n, -1).sort(-1).values
                engine = s.routes[:, k].long().sort(-1).values
                equal += int((chosen == engine).all(-1).sum())
                total += n
    return equal / total


def test_replay_uses_the_engines_experts_and_off_does_not(make_actor):
    on = make_actor(True)
    seqs = engine_sequences(on)
    assert all(s.routes is not None and s.routes.shape[1:] == (3, 2) for s in seqs)
    assert used_routes(on, seqs) == 1.0
    off = make_actor(False)
    seqs = engine_sequences(off)
    assert used_routes(off, seqs) < 0.9  # the perturbed engine routes elsewhere: without replay the trainer differs


def test_replay_on_without_routes_is_an_error_naming_the_key(make_actor):
    actor = make_actor(True)
    seqs = engine_sequences(actor)
    seqs[1].routes = None
    with pytest.raises(ConfigError, match=r"rollout.routing_replay is on but 1 of 6 samples came back without routes"):
        actor.train_step(seqs)


def test_the_step_logs_agreement_coverage_both_gaps_and_the_aux_loss(make_actor):
    actor = make_actor(True, "model.moe_aux_loss_coeff=0.01")
    seqs = engine_sequences(actor)
    metrics = actor.train_step(seqs)
    # megatron-core's switch load-balancing loss, before its coefficient: 1 when perfectly balanced, at most E / k
    assert 0.9 < metrics["train/moe_load_balancing_loss"] < 6 / 2, metrics
    assert metrics["routing/coverage"] == 1.0
    assert metrics["routing/agreement"] < 0.9  # the trainer on its own does not route like the perturbed engine
    assert metrics["routing/logp_gap_replay"] < metrics["routing/logp_gap_no_replay"]


def test_a_dense_model_refuses_replay():
    with pytest.raises(ConfigError, match="rollout.routing_replay = true: tiny has no experts"):
        from megatron_dapo.models.arch import load_arch, routing_replay_enabled

        routing_replay_enabled(True, load_arch("tiny"))


def test_replay_without_routes_from_the_server_is_an_error_naming_the_flag():
    """A server started without --enable-return-routed-experts answers with no routes: never a silent fallback."""
    with pytest.raises(RolloutError, match="enable-return-routed-experts"):
        RouteLayout(4, (0, 2, 3), 2).decode(None, 5, "r1")
    with pytest.raises(RolloutError, match="expected 4 positions"):
        RouteLayout(4, (0, 2, 3), 2).decode("AAAAAA==", 5, "r1")


def test_full_recompute_replays_in_the_recomputed_forward_too(make_actor):
    """With model.recompute=full every layer's forward runs again in the backward; there the routers replay the same
    routes (megatron-core REPLAY_BACKWARD), so the step equals the one without recompute. Routing on its own in the
    recomputed forward (the perturbed engine routes elsewhere) would give other gradients."""
    plain = make_actor(True)
    want = plain.train_step(engine_sequences(plain))
    full = make_actor(True, "model.recompute=full")
    got = full.train_step(engine_sequences(full))
    for key in ("train/loss", "train/grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (key, got[key], want[key])


def test_replay_off_measures_agreement_and_warns_naming_the_key(make_actor, caplog):
    """Off, the engine's routes still come with the samples: the step logs how often the trainer routes alike, and
    low agreement is a warning naming rollout.routing_replay (verl #7340: replay silently off)."""
    import logging

    from megatron_dapo.actor import routes

    routes._warned[0] = False
    actor = make_actor(False)
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.actor.routes"):
        metrics = actor.train_step(engine_sequences(actor))
    assert metrics["routing/agreement"] < routes.LOW_AGREEMENT and "routing/coverage" not in metrics
    assert metrics["routing/logp_gap_replay"] < metrics["routing/logp_gap_no_replay"]
    assert any("rollout.routing_replay=false" in r.getMessage() for r in caplog.records), caplog.text
