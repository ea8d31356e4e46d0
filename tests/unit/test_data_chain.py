"""The chain-sum task of the ablation: disjoint splits, written-out solutions the DAPO rule scores +1, lengths that
straddle the 24-token limit, and the warm start's targets."""

from megatron_dapo.data.chain import chain_solution, chain_splits
from megatron_dapo.data.synthetic import supervised_target_ids
from megatron_dapo.data.tokenizer import CharTokenizer
from megatron_dapo.reward.math_dapo import compute_score


def test_solution_by_hand_and_scored_by_the_dapo_rule():
    assert chain_solution([3, 5, 2, 7]) == " 3 8 10 17 Answer: 17"
    assert compute_score(chain_solution([3, 5, 2, 7]), "17")["score"] == 1.0
    assert compute_score(" 3 8 10 17 Answer: 18", "17")["score"] == -1.0


def test_splits_are_disjoint_seeded_and_spread_over_lengths():
    train, evals = chain_splits(3000, 200, seed=7, max_terms=7)
    key = lambda r: r["prompt"][0]["content"]  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in evals}
    assert len({key(r) for r in evals}) == 200
    assert [key(r) for r in chain_splits(3000, 200, seed=7)[0][:20]] == [key(r) for r in train[:20]]
    tok = CharTokenizer()
    lengths: dict[int, list[int]] = {}
    for r in train:
        ids = supervised_target_ids(tok, "", {"extra_info": r["extra_info"]})
        lengths.setdefault(r["extra_info"]["terms"], []).append(len(ids))
    assert sorted(lengths) == [2, 3, 4, 5, 6, 7]
    assert max(lengths[2]) <= 17 and min(lengths[7]) > 24  # short ones fit in 24 tokens; long written-out chains not
    ids = supervised_target_ids(tok, "17", {"extra_info": {"solution": " 3 8 10 17 Answer: 17"}})
    assert tok.decode(ids[:-1]) == " 3 8 10 17 Answer: 17" and ids[-1] == tok.eos_token_id
    assert tok.decode(supervised_target_ids(tok, "52")[:-1]) == " Answer: 52"  # add2: no written-out solution
