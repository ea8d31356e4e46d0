"""One DAPO update through the real megatron-core actor moves each response's logprob by what the objective predicts.

A fixed prompt with four responses of known reward goes through the trainer's own path: ``to_sequences`` (group
advantages), ``MegatronActor.train_step`` (π_old from the training forward, the clipped token-mean loss, the global
denominator, Adam). The prediction is independent of that path, by hand:

- at the first mini-batch the ratio is 1, so the loss is −Σ_i A_i·w_i·|y_i| / Σ_i |y_i| (w_i = 1 without TIS) and its
  gradient g = −Σ_i A_i·w_i·G_i / Σ_i |y_i|, with G_i = ∇ Σ_t log π(y_i,t) computed per response by autograd;
- Adam's first step (fresh moments, bias-corrected, no weight decay) on the clipped gradient c·g is
  Δθ = −lr · c·g / (|c·g| + eps) per element, so response j's summed logprob moves by G_j · Δθ to first order.

The test checks the logged loss and gradient norm against that hand computation, every response's measured change
against its first-order prediction (sign and size), and that the positive-advantage responses rise and the negative
ones fall. A flipped advantage or loss sign, a wrong denominator or gradient scale, or TIS weights left out fails it.
"""

import math

import pytest
import torch

LR = 2e-5  # small enough that the first-order prediction holds to a few percent on this 0.5M-parameter model
PROMPT = "Q: 07+45="
# (response, reward): lengths differ (the token-mean loss at ratio 1 is not 0); A = ±0.866. The negative ones share no
# prefix with the positive ones: a shared " Answer: " would rise with them (as the objective predicts).
RESPONSES = [(" Answer: 52", 1.0), (" Answer: 52\n52", 1.0), ("61", -1.0), ("9=", -1.0)]


def _cfg(*extra):
    from megatron_dapo.config.run_config import load_config

    return load_config("demo_cpu", [
        "train.batch_prompts=1", "train.mini_batch_prompts=1", "algo.group_size=4", f"train.lr={LR}",
        "train.warmup_steps=0", "train.min_lr=null", "train.weight_decay=0.0", "train.grad_clip=1.0",
        "parallel.max_tokens_per_micro_batch=256", *extra,
    ])  # fmt: skip


@pytest.fixture
def make_actor():
    """A fresh actor (fresh Adam moments) of ``_cfg(*extra)``; torn down after the test."""
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.dist import teardown

    yield lambda *extra: MegatronActor(_cfg(*extra))
    teardown()


def _groups(tok, rollout_shift=None):
    """One group; ``rollout_shift[j]`` = log w_j: the rollout logprobs are set to π_old − log w_j (filled in later)."""
    from megatron_dapo.algo.batch import Group

    prompt = tok.encode(PROMPT)
    responses = [tok.encode(text) + [tok.eos_token_id] for text, _ in RESPONSES]
    return [Group(prompt_ids=prompt, responses=responses, rollout_logprobs=[[] for _ in responses],
                  finish_reasons=["stop"] * 4, scores=[r for _, r in RESPONSES], correct=[r > 0 for _, r in RESPONSES],
                  data_source="synthetic/add2")]  # fmt: skip


def _params(actor):
    return [p for m in actor.model for p in m.module.parameters()]


def _response_grads(actor, seqs) -> list[torch.Tensor]:
    """G_j = ∇ Σ_t log π(y_j,t) for each response, flattened over every parameter (autograd through the model)."""
    grads = []
    for s in seqs:
        for m in actor.model:
            m.zero_grad_buffer()

        def loss_fn(mb, model, hidden):
            lp, _ = actor._token_logprobs(mb, model, hidden, with_entropy=False)
            return lp.sum(), {}

        actor._run(actor._micro_batches([s]), loss_fn, forward_only=False)
        grads.append(torch.cat([p.main_grad.detach().flatten().clone() for p in _params(actor)]))
    for m in actor.model:
        m.zero_grad_buffer()
    return grads


def _step_and_predict(actor, seqs, weights):
    """Train one step on ``seqs``; return (metrics, measured Δ summed logprob, predicted Δ, hand loss, hand g)."""
    before = [lp.sum() for lp in actor.compute_logprobs(seqs)]
    grads = _response_grads(actor, seqs)
    n = sum(s.response_len for s in seqs)
    adv = [s.advantage for s in seqs]
    hand_loss = -sum(a * w * s.response_len for a, w, s in zip(adv, weights, seqs)) / n
    g = -sum(a * w * G for a, w, G in zip(adv, weights, grads)) / n
    t = actor.cfg.train
    clipped = g * min(1.0, t.grad_clip / (float(g.norm()) + 1e-6))  # megatron-core's clip coefficient
    delta = -LR * clipped / (clipped.abs() + t.adam_eps)  # Adam's first step
    predicted = [float(G @ delta) for G in grads]
    params_before = torch.cat([p.detach().flatten().clone() for p in _params(actor)])
    for s in seqs:
        s.old_logprobs = None  # π_old from the training forward, as the trainer does
    metrics = actor.train_step(seqs)
    params_after = torch.cat([p.detach().flatten() for p in _params(actor)])
    after = [lp.sum() for lp in actor.compute_logprobs(seqs)]
    measured = [float(b - a) for a, b in zip(before, after)]
    # the update the optimizer made is Adam's first step on the hand gradient (where |c·g| >> eps: below that the
    # quotient amplifies the summation order's rounding)
    firm = clipped.abs() > 100 * t.adam_eps
    assert float(firm.float().mean()) > 0.9
    err = (params_after - params_before - delta)[firm].abs().max()
    assert err < 0.02 * LR, f"the update is not Adam's first step on the hand gradient: off by {err:.2e}"
    return metrics, measured, predicted, hand_loss, g


def test_one_update_moves_each_response_as_the_objective_predicts(make_actor):
    from megatron_dapo.algo.batch import to_sequences
    from megatron_dapo.data.tokenizer import load_tokenizer

    actor = make_actor()
    tok = load_tokenizer(None)
    seqs, m = to_sequences(_groups(tok), actor.cfg)
    adv = [s.advantage for s in seqs]
    # group advantages by hand: rewards (1, 1, -1, -1), mean 0, unbiased std 2/sqrt(3)
    assert adv == pytest.approx([math.sqrt(3) / 2, math.sqrt(3) / 2, -math.sqrt(3) / 2, -math.sqrt(3) / 2], rel=1e-5)
    metrics, measured, predicted, hand_loss, g = _step_and_predict(actor, seqs, [1.0] * 4)

    assert metrics["train/loss"] == pytest.approx(hand_loss, rel=1e-5) and hand_loss < 0
    assert metrics["train/grad_norm"] == pytest.approx(float(g.norm()), rel=1e-4)
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    for j, ((_, reward), mes, pred) in enumerate(zip(RESPONSES, measured, predicted)):  # signs from the rewards
        assert math.copysign(1, pred) == reward, f"response {j}: the objective itself predicts {pred}"
        assert math.copysign(1, mes) == reward, f"response {j} (reward {reward:+}) moved {mes:+.4f}"
        assert mes == pytest.approx(pred, rel=0.1), f"response {j}: measured {mes:+.5f}, predicted {pred:+.5f}"
    assert min(abs(x) for x in measured) > 1e-3  # a real move, far above fp32 noise


def test_tis_weights_reach_the_loss_through_the_actor(make_actor):
    """algo.tis = on: the group's rollout logprobs become each token's weight min(π_old/π_rollout, C) in the loss
    (hand loss and gradient with the weights), and ``train/tis_*`` are reported. Weights 0.5, 1.5, 3 (capped at 2),
    and 1."""
    from megatron_dapo.algo.batch import to_sequences
    from megatron_dapo.data.tokenizer import load_tokenizer

    actor = make_actor('algo.tis="on"', "algo.tis_cap=2.0")
    tok = load_tokenizer(None)
    groups = _groups(tok)
    seqs, _ = to_sequences(groups, actor.cfg)
    old = actor.compute_logprobs(seqs)
    log_w = [math.log(0.5), math.log(1.5), math.log(3.0), 0.0]
    for g_resp, lp, lw in zip(range(4), old, log_w):
        groups[0].rollout_logprobs[g_resp] = (lp - lw).tolist()  # π_rollout = π_old / w
    seqs, _ = to_sequences(groups, actor.cfg)  # the rollout logprobs routed as the trainer routes them
    assert all(s.rollout_logprobs is not None for s in seqs)
    capped = [0.5, 1.5, 2.0, 1.0]
    metrics, measured, predicted, hand_loss, g = _step_and_predict(actor, seqs, capped)
    lens = [s.response_len for s in seqs]
    assert metrics["train/loss"] == pytest.approx(hand_loss, rel=1e-4)
    assert metrics["train/grad_norm"] == pytest.approx(float(g.norm()), rel=1e-4)
    assert metrics["train/tis_mean"] == pytest.approx(sum(w * n for w, n in zip(capped, lens)) / sum(lens), 1e-4)
    assert metrics["train/tis_capped_frac"] == pytest.approx(lens[2] / sum(lens), abs=1e-6)
    assert metrics["train/tis_max"] == pytest.approx(3.0, rel=1e-4)
    for mes, pred in zip(measured, predicted):
        assert mes == pytest.approx(pred, rel=0.1)


def test_the_configured_correction_reaches_the_loss_through_the_actor(make_actor):
    """algo.correction = icepop with bounds [0.6, 1.8]: of the weights 0.5, 1.5, 3 and 1 the outside ones mask their
    response (weight 0) and the others weigh 1; ``train/tis_masked_frac`` counts the masked tokens."""
    from megatron_dapo.algo.batch import to_sequences
    from megatron_dapo.data.tokenizer import load_tokenizer

    actor = make_actor('algo.tis="on"', "algo.correction=icepop", "algo.correction_bounds=[0.6,1.8]")
    groups = _groups(load_tokenizer(None))
    seqs, _ = to_sequences(groups, actor.cfg)
    for j, (lp, lw) in enumerate(zip(actor.compute_logprobs(seqs), [math.log(0.5), math.log(1.5), math.log(3.0), 0])):
        groups[0].rollout_logprobs[j] = (lp - lw).tolist()
    seqs, _ = to_sequences(groups, actor.cfg)
    weights = [0.0, 1.0, 0.0, 1.0]
    metrics, measured, predicted, hand_loss, g = _step_and_predict(actor, seqs, weights)
    lens = [s.response_len for s in seqs]
    assert metrics["train/loss"] == pytest.approx(hand_loss, rel=1e-4)
    assert metrics["train/grad_norm"] == pytest.approx(float(g.norm()), rel=1e-4)
    assert metrics["train/tis_masked_frac"] == pytest.approx((lens[0] + lens[2]) / sum(lens), abs=1e-6)


@pytest.mark.parametrize(
    "correction, weights", [("icepop", [1.1, 0.95, 0.0, 1.0]), ("token_tis", [1.1, 0.95, 3.0, 1.0])]
)
def test_pi_old_from_the_rollout_takes_the_ratio_against_it_and_the_correction_only_rejects(
    make_actor, correction, weights
):
    """algo.old_logprobs = rollout: no π_old pass; the PPO ratio at the first update is π/π_rollout = w_j per response
    (1.1, 0.95, 3, 1; the negative-advantage w = 3 is not clipped), so the loss and gradient weigh each response by
    it, except that IcePop masks w = 3 (outside [0.5, 2]); a correction never multiplies by w again (token TIS would
    make 1.21, 0.9025, 6, 1): rejection only."""
    from megatron_dapo.algo.batch import to_sequences
    from megatron_dapo.data.tokenizer import load_tokenizer

    actor = make_actor('algo.old_logprobs="rollout"', 'algo.tis="on"', f"algo.correction={correction}")
    groups = _groups(load_tokenizer(None))
    seqs, _ = to_sequences(groups, actor.cfg)
    ratios = [1.1, 0.95, 3.0, 1.0]
    for j, (lp, w) in enumerate(zip(actor.compute_logprobs(seqs), ratios)):
        groups[0].rollout_logprobs[j] = (lp - math.log(w)).tolist()
    seqs, _ = to_sequences(groups, actor.cfg)
    metrics, measured, predicted, hand_loss, g = _step_and_predict(actor, seqs, weights)
    assert metrics["train/old_logprob_pass_seqs"] == 0
    assert metrics["train/loss"] == pytest.approx(hand_loss, rel=1e-4)
    assert metrics["train/grad_norm"] == pytest.approx(float(g.norm()), rel=1e-4)
    assert metrics["train/ratio_max"] == pytest.approx(3.0, rel=1e-4)
