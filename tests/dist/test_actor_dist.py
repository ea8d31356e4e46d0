"""The megatron-core actor across TP / PP / DP (torchrun, gloo) — acceptance of the actor issue.

Every scenario of the module runs in five torchrun launches (``runs``), built once per module: the TP=1 initial
checkpoint, the 2-process and 4-process scenarios, the 1-process ones, and the resume in a fresh process (a resume
must not lean on what a process still holds). The tests compare the files those launches wrote.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import run_torchrun

WORKER = Path(__file__).with_name("actor_worker.py")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

# Adam's first update is lr·g/(|g|+eps): for gradients near 0 it turns fp32 summation-order noise into lr-sized
# differences, so the equality tests use a large adam_eps, making the update proportional to the gradient there.
ADAM_EPS = "train.adam_eps=1e-3"
TP_PP = [(2, 1), (1, 2), (2, 2)]
PACK = (40, 64, 4096)  # 64-token budget packs several sequences per micro-batch; 40 holds one or two; 4096 all


def _batch(d: Path, nproc: int, name: str, scenarios: list[tuple[str, str, list[str]]]) -> None:
    """One torchrun of ``nproc`` ranks running ``scenarios`` ((scenario, output file, k=v args)) in order."""
    plan = d / f"plan_{name}.json"
    plan.write_text(json.dumps([[sc, str(d / out), args] for sc, out, args in scenarios]))
    run_torchrun(nproc, WORKER, "--batch", plan, timeout=600)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """All the module's launches; returns the folder of their outputs."""
    d = tmp_path_factory.mktemp("actor")
    ck0 = f"load={d / 'ckpt0'}"
    # A TP=1 actor's initial checkpoint and its logprobs on fixed sequences
    run_torchrun(1, WORKER, "init", d / "init.pt", f"save={d / 'ckpt0'}")
    _batch(d, 2, "two", [
        *[("logprobs", f"lp_{tp}_{pp}.pt", [f"parallel.tp={tp}", f"parallel.pp={pp}", ck0])
          for tp, pp in TP_PP if tp * pp == 2],
        ("train", "dp2.pt", [ADAM_EPS, ck0]),
        ("logprobs", "share_pp2.pt", ["group=4", "parallel.pp=2", ck0]),
        ("train", "tp2_train.pt", ["parallel.tp=2", ck0, f"save={d / 'ckpt_tp2'}"]),
        ("two_steps", "tp2_two_steps.pt", ["parallel.tp=2", ADAM_EPS, ck0, f"save={d / 'mid_tp2'}"]),
    ])  # fmt: skip
    _batch(d, 4, "four", [("logprobs", "lp_2_2.pt", ["parallel.tp=2", "parallel.pp=2", ck0])])
    one = [("train", "dp1.pt", [ADAM_EPS, ck0])]
    one += [("train", f"pack_{b}.pt", [ADAM_EPS, f"parallel.max_tokens_per_micro_batch={b}", ck0]) for b in PACK]
    one += [("train", "one_update.pt", ["train.mini_batch_prompts=4", ck0])]
    for updates in (1, 2):
        mini = f"train.mini_batch_prompts={4 // updates}"
        one += [("train", f"recomputed{updates}.pt", [mini, ADAM_EPS, ck0]),
                ("train_reuse", f"reused{updates}.pt", [mini, ADAM_EPS, ck0])]  # fmt: skip
    one += [("logprobs", "lp_init.pt", [ck0])]
    one += [("train", f"share_{sh}.pt", [ADAM_EPS, "group=4", f"parallel.share_prompts={sh}", ck0])
            for sh in ("true", "false")]  # fmt: skip
    one += [("logprobs", "share_pp1.pt", ["group=4", ck0]),
            ("logprobs", "tp1_from_tp2.pt", [f"load={d / 'ckpt_tp2'}"]),
            ("two_steps", "uninterrupted.pt", [ck0, f"save={d / 'mid'}"]),
            ("continue", "tp1_continued_from_tp2.pt", [ADAM_EPS, f"load={d / 'mid_tp2'}"])]  # fmt: skip
    _batch(d, 1, "one", one)
    run_torchrun(1, WORKER, "continue", d / "resumed.pt", f"load={d / 'mid'}")
    return d


def _close(a, b, tol):
    assert len(a) == len(b)
    gap = max(float((x - y).abs().max()) for x, y in zip(a, b))
    assert gap <= tol, f"max |Δlogprob| = {gap}"
    return gap


@pytest.mark.parametrize("tp,pp", TP_PP)
def test_logprobs_equal_across_tp_pp(base, tp, pp):
    ref = torch.load(base / "init.pt")["logprobs"]
    _close(ref, torch.load(base / f"lp_{tp}_{pp}.pt")["logprobs"], 1e-5)


def test_dp2_step_equals_dp1(base):
    a, b = torch.load(base / "dp1.pt"), torch.load(base / "dp2.pt")
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        torch.testing.assert_close(a["params"][name], b["params"][name], rtol=0, atol=1e-6, msg=name)
    # the step changed the weights (otherwise equality would be vacuous)
    init = torch.load(base / "init.pt")["logprobs"]
    assert max(float((x - y).abs().max()) for x, y in zip(init, a["logprobs"])) > 1e-3
    assert a["metrics"]["train/loss"] == pytest.approx(b["metrics"]["train/loss"], abs=1e-6)


def test_packing_and_micro_batch_split_do_not_change_the_step(base):
    outs = [torch.load(base / f"pack_{budget}.pt") for budget in PACK]
    for other in outs[1:]:
        assert other["metrics"]["train/loss"] == pytest.approx(outs[0]["metrics"]["train/loss"], abs=1e-6)
        for name, p in outs[0]["params"].items():
            torch.testing.assert_close(other["params"][name], p, rtol=0, atol=2e-6, msg=name)


def test_first_minibatch_ratio_is_one(base):
    m = torch.load(base / "one_update.pt")["metrics"]
    assert m["train/ratio_mean"] == 1.0 and m["train/ratio_max"] == 1.0 and m["train/ratio_min"] == 1.0
    assert m["train/ppo_kl"] == 0.0
    assert m["train/clip_frac_high"] == 0.0 and m["train/clip_frac_low"] == 0.0


@pytest.mark.parametrize("updates", [1, 2])
def test_old_logprobs_from_the_first_forward_equal_the_recomputed_pass(base, updates):
    """train_step without old logprobs skips the pass for the first mini-batch (π_old = current policy there) and
    computes the rest before any update: the step equals the one with every old logprob recomputed first."""
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
    outs = {share: torch.load(base / f"share_{share}.pt") for share in ("true", "false")}
    assert outs["true"]["metrics"]["train/loss"] == pytest.approx(outs["false"]["metrics"]["train/loss"], abs=1e-6)
    for name, p in outs["false"]["params"].items():
        torch.testing.assert_close(outs["true"]["params"][name], p, rtol=0, atol=2e-6, msg=name)
    _close(outs["true"]["logprobs"], outs["false"]["logprobs"], 2e-6)
    _close(torch.load(base / "share_pp1.pt")["logprobs"], torch.load(base / "share_pp2.pt")["logprobs"], 1e-5)


def test_save_tp2_load_tp1_equal_logprobs(base):
    a = torch.load(base / "tp2_train.pt")["logprobs"]
    b = torch.load(base / "tp1_from_tp2.pt")
    _close(a, b["logprobs"], 1e-5)
    assert b["extra"] == {"cursor": 7}


def test_tp2_optimizer_state_resharded_to_tp1_takes_the_same_step(base):
    """TP2: step, save (weights + Adam moments), step. TP1 from that checkpoint: the same second step — its Adam
    moments are the TP2 ones, resharded (a fresh or misplaced optimizer state takes a different step)."""
    a, b = torch.load(base / "tp2_two_steps.pt"), torch.load(base / "tp1_continued_from_tp2.pt")
    assert b["extra"] == {"cursor": 7}
    for key in ("train/loss", "train/grad_norm", "train/ppo_kl"):
        assert b["metrics"][key] == pytest.approx(a["metrics"][key], rel=1e-4, abs=1e-6), key
    _close(a["logprobs"], b["logprobs"], 1e-5)


def test_resume_is_bit_exact(base):
    a, b = torch.load(base / "uninterrupted.pt"), torch.load(base / "resumed.pt")
    for key in ("train/loss", "train/grad_norm", "train/ppo_kl", "train/lr"):
        assert a["metrics"][key] == b["metrics"][key], key
    for x, y in zip(a["logprobs"], b["logprobs"]):
        assert torch.equal(x, y)
