"""The megatron-core actor across TP / PP / DP (torchrun, gloo) — acceptance of the actor issue."""

from pathlib import Path

import pytest
import torch

from tests.helpers import run_torchrun

WORKER = Path(__file__).with_name("actor_worker.py")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A TP=1 actor's initial checkpoint and its logprobs on fixed sequences."""
    d = tmp_path_factory.mktemp("actor")
    run_torchrun(1, WORKER, "init", d / "init.pt", f"save={d / 'ckpt0'}")
    return d


def _close(a, b, tol):
    assert len(a) == len(b)
    gap = max(float((x - y).abs().max()) for x, y in zip(a, b))
    assert gap <= tol, f"max |Δlogprob| = {gap}"
    return gap


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_logprobs_equal_across_tp_pp(base, tp, pp):
    ref = torch.load(base / "init.pt")["logprobs"]
    out = base / f"lp_{tp}_{pp}.pt"
    run_torchrun(tp * pp, WORKER, "logprobs", out, f"parallel.tp={tp}", f"parallel.pp={pp}", f"load={base / 'ckpt0'}")
    _close(ref, torch.load(out)["logprobs"], 1e-5)


# Adam's first update is lr·g/(|g|+eps): for gradients near 0 it turns fp32 summation-order noise into lr-sized
# differences, so the equality tests use a large adam_eps, making the update proportional to the gradient there.
ADAM_EPS = "train.adam_eps=1e-3"


def test_dp2_step_equals_dp1(base):
    run_torchrun(1, WORKER, "train", base / "dp1.pt", ADAM_EPS, f"load={base / 'ckpt0'}")
    run_torchrun(2, WORKER, "train", base / "dp2.pt", ADAM_EPS, f"load={base / 'ckpt0'}")
    a, b = torch.load(base / "dp1.pt"), torch.load(base / "dp2.pt")
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        torch.testing.assert_close(a["params"][name], b["params"][name], rtol=0, atol=1e-6, msg=name)
    # the step changed the weights (otherwise equality would be vacuous)
    init = torch.load(base / "init.pt")["logprobs"]
    assert max(float((x - y).abs().max()) for x, y in zip(init, a["logprobs"])) > 1e-3
    assert a["metrics"]["train/loss"] == pytest.approx(b["metrics"]["train/loss"], abs=1e-6)


def test_packing_and_micro_batch_split_do_not_change_the_step(base):
    # 64-token budget packs several sequences per micro-batch; 40 holds one or two; 4096 holds all at once.
    outs = []
    for budget in (40, 64, 4096):
        out = base / f"pack_{budget}.pt"
        run_torchrun(
            1, WORKER, "train", out, ADAM_EPS, f"parallel.max_tokens_per_micro_batch={budget}", f"load={base / 'ckpt0'}"
        )
        outs.append(torch.load(out))
    for other in outs[1:]:
        assert other["metrics"]["train/loss"] == pytest.approx(outs[0]["metrics"]["train/loss"], abs=1e-6)
        for name, p in outs[0]["params"].items():
            torch.testing.assert_close(other["params"][name], p, rtol=0, atol=2e-6, msg=name)


def test_first_minibatch_ratio_is_one(base):
    out = base / "one_update.pt"
    run_torchrun(1, WORKER, "train", out, "train.mini_batch_prompts=4", f"load={base / 'ckpt0'}")
    m = torch.load(out)["metrics"]
    assert m["train/ratio_mean"] == 1.0 and m["train/ratio_max"] == 1.0 and m["train/ratio_min"] == 1.0
    assert m["train/ppo_kl"] == 0.0
    assert m["train/clip_frac_high"] == 0.0 and m["train/clip_frac_low"] == 0.0


@pytest.mark.parametrize("updates", [1, 2])
def test_old_logprobs_from_the_first_forward_equal_the_recomputed_pass(base, updates):
    """train_step without old logprobs skips the pass for the first mini-batch (π_old = current policy there) and
    computes the rest before any update: the step equals the one with every old logprob recomputed first."""
    mini = f"train.mini_batch_prompts={4 // updates}"
    run_torchrun(1, WORKER, "train", base / f"recomputed{updates}.pt", mini, ADAM_EPS, f"load={base / 'ckpt0'}")
    run_torchrun(1, WORKER, "train_reuse", base / f"reused{updates}.pt", mini, ADAM_EPS, f"load={base / 'ckpt0'}")
    if not (base / "lp_init.pt").is_file():  # the same for both parametrizations (module-scoped ``base``)
        run_torchrun(1, WORKER, "logprobs", base / "lp_init.pt", f"load={base / 'ckpt0'}")
    a, b = torch.load(base / f"recomputed{updates}.pt"), torch.load(base / f"reused{updates}.pt")
    for key in ("train/loss", "train/grad_norm", "train/ppo_kl", "train/ratio_mean", "train/clip_frac_low"):
        assert b["metrics"][key] == pytest.approx(a["metrics"][key], abs=1e-6), key
    for name, p in a["params"].items():  # the later mini-batches' π_old come from a pass over other micro-batches
        torch.testing.assert_close(b["params"][name], p, rtol=0, atol=2e-6, msg=name)  # (fp32 summation order)
    ref = torch.load(base / "lp_init.pt")  # π_old = the policy before the step, for every sequence
    _close(ref["logprobs"], b["old_logprobs"], 1e-6)
    _close(ref["entropy"], b["entropy"], 1e-6)
    # the separate pass ran only for the later mini-batches: none with one update, half of the 8 with two
    assert b["metrics"]["train/old_logprob_pass_seqs"] == (0 if updates == 1 else 4)


def test_shared_prompt_rows_equal_one_row_per_sequence(base):
    """Groups of 4 sharing a prompt: the step with shared-prompt rows equals the one with a row per sequence, and at
    PP = 2 (variable batch shapes and explicit positions through the pipeline) the logprobs equal PP = 1's."""
    outs = {}
    for share in ("true", "false"):
        out = base / f"share_{share}.pt"
        run_torchrun(1, WORKER, "train", out, ADAM_EPS, "group=4", f"parallel.share_prompts={share}",
                     f"load={base / 'ckpt0'}")  # fmt: skip
        outs[share] = torch.load(out)
    assert outs["true"]["metrics"]["train/loss"] == pytest.approx(outs["false"]["metrics"]["train/loss"], abs=1e-6)
    for name, p in outs["false"]["params"].items():
        torch.testing.assert_close(outs["true"]["params"][name], p, rtol=0, atol=2e-6, msg=name)
    _close(outs["true"]["logprobs"], outs["false"]["logprobs"], 2e-6)
    run_torchrun(2, WORKER, "logprobs", base / "share_pp2.pt", "group=4", "parallel.pp=2", f"load={base / 'ckpt0'}")
    run_torchrun(1, WORKER, "logprobs", base / "share_pp1.pt", "group=4", f"load={base / 'ckpt0'}")
    _close(torch.load(base / "share_pp1.pt")["logprobs"], torch.load(base / "share_pp2.pt")["logprobs"], 1e-5)


def test_save_tp2_load_tp1_equal_logprobs(base):
    run_torchrun(
        2,
        WORKER,
        "train",
        base / "tp2_train.pt",
        "parallel.tp=2",
        f"load={base / 'ckpt0'}",
        f"save={base / 'ckpt_tp2'}",
    )
    run_torchrun(1, WORKER, "logprobs", base / "tp1_from_tp2.pt", f"load={base / 'ckpt_tp2'}")
    a = torch.load(base / "tp2_train.pt")["logprobs"]
    b = torch.load(base / "tp1_from_tp2.pt")
    _close(a, b["logprobs"], 1e-5)
    assert b["extra"] == {"cursor": 7}


def test_resume_is_bit_exact(base):
    run_torchrun(1, WORKER, "two_steps", base / "uninterrupted.pt", f"load={base / 'ckpt0'}", f"save={base / 'mid'}")
    run_torchrun(1, WORKER, "continue", base / "resumed.pt", f"load={base / 'mid'}")
    a, b = torch.load(base / "uninterrupted.pt"), torch.load(base / "resumed.pt")
    for key in ("train/loss", "train/grad_norm", "train/ppo_kl", "train/lr"):
        assert a["metrics"][key] == b["metrics"][key], key
    for x, y in zip(a["logprobs"], b["logprobs"]):
        assert torch.equal(x, y)
