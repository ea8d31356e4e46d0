"""The ablation toy chain_mix (issue 25): splits fixed by the problem (no seed trains on an eval or dev problem; every
seed evaluates on the same problems), both styles scored +1 by the DAPO rule, every written-out solution inside the
recipe's no-penalty region with margin, a warm start that mixes the styles half and half."""

import pytest

from megatron_dapo.config.run_config import load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.data.chain_mix import (
    DATA_SOURCE,
    held_out_rows,
    problem,
    split_of,
    steps,
    train_rows,
    written_solution,
)
from megatron_dapo.data.sources import build_prompt_datasets
from megatron_dapo.data.synthetic import supervised_target_ids
from megatron_dapo.data.tokenizer import CharTokenizer
from megatron_dapo.reward.math_dapo import compute_score


def _key(row: dict) -> str:
    return row["prompt"][0]["content"]


def test_splits_are_fixed_by_the_problem_and_disjoint_for_every_seed():
    evals, dev = held_out_rows("eval", 200, 6), held_out_rows("dev", 200, 6)
    assert [_key(r) for r in evals] == [_key(r) for r in held_out_rows("eval", 200, 6)]  # no seed in it
    assert len({_key(r) for r in evals}) == len({_key(r) for r in dev}) == 200
    assert not {_key(r) for r in evals} & {_key(r) for r in dev}
    for seed in (1, 2):
        train = train_rows(3000, seed, 6)
        assert not {_key(r) for r in train} & ({_key(r) for r in evals} | {_key(r) for r in dev})
        assert {split_of([int(c) for c in _key(r)[:-1].split()]) for r in train} == {"train"}
    terms = [r["extra_info"]["terms"] for r in evals]
    assert set(terms) == {2, 3, 4, 5, 6} and min(terms.count(k) for k in (3, 4, 5, 6)) >= 45  # stratified


def test_the_chain_by_hand():
    assert problem([3, 5, 2, 7]) == "3 5 2 7=" and steps([3, 5, 2, 7]) == [3, 2, 0, 7]
    assert written_solution([3, 5, 2, 7]) == " 2 0 7 Answer: 7"
    assert compute_score(" Answer: 7", "7")["score"] == 1.0 and compute_score(" 2 0 7 Answer: 6", "7")["score"] == -1


def test_both_styles_score_and_the_written_ones_fit_the_no_penalty_region_with_margin():
    cfg = load_config("chain_mix_cpu")
    no_penalty = cfg.rollout.sampling.max_new_tokens - cfg.algo.overlong_cache
    tok = CharTokenizer()
    rows = train_rows(4000, 7, cfg.data.chain_max_terms)
    lengths = {"direct": [], "written": []}
    for r in rows:
        info = r["extra_info"]
        assert compute_score(info["solution"], r["reward_model"]["ground_truth"])["score"] == 1.0
        lengths[info["style"]].append(len(supervised_target_ids(tok, "", {"extra_info": info})))
    assert 0.45 < len(lengths["direct"]) / len(rows) < 0.55
    assert max(lengths["direct"]) <= 12 < min(lengths["written"])
    assert max(lengths["written"]) <= 0.85 * no_penalty  # the longest reference, eos included, with margin
    prompts = [len(tok.apply_chat_template(r["prompt"], add_generation_prompt=True)) for r in rows]
    assert max(prompts) <= cfg.data.max_prompt_len


def test_the_config_builds_the_eval_or_the_dev_set_and_refuses_dev_elsewhere():
    tok = CharTokenizer()
    small = ["data.synthetic_train_size=50", "data.synthetic_eval_size=40"]
    _, evals = build_prompt_datasets(load_config("chain_mix_cpu", small), tok)
    _, devs = build_prompt_datasets(load_config("chain_mix_cpu", [*small, "data.synthetic_eval_split=dev"]), tok)
    assert list(evals) == [DATA_SOURCE] and list(devs) == [f"{DATA_SOURCE}-dev"]
    assert not {it.prompt_text for it in evals[DATA_SOURCE]} & {it.prompt_text for it in devs[f"{DATA_SOURCE}-dev"]}
    with pytest.raises(ConfigError, match="data.synthetic_eval_split"):
        load_config("chain_cpu", ["data.synthetic_eval_split=dev"])
