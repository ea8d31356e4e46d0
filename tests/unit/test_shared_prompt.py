"""Rows in which a group's responses share their prompt: the layout by hand, attention equal to separate rows, the
FLOP decision, and the actor's logprobs equal to one row per sequence."""

import pytest
import torch

from megatron_dapo.data.shared_prompt import plan_rows, prompt_groups, share_prompt, shared_prompt_batch


def test_layout_by_hand():
    seqs = [torch.tensor([5, 6, 7, 1, 2]), torch.tensor([5, 6, 7, 3]), torch.tensor([9, 8, 4, 4, 4])]
    b = shared_prompt_batch(seqs, [3, 3, 2], [[0, 1], [2]])
    assert b.tokens.tolist() == [[5, 6, 7, 1, 2, 3], [9, 8, 4, 4, 4, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 3, 4, 0]]
    # response tokens: 1 (predicted by 7 at index 2), 2 (by 1 at 3), 3 (by 7 at 2 again), then 4, 4, 4 of row 1
    assert b.target_index.tolist() == [2, 3, 2, 6 + 1, 6 + 2, 6 + 3]
    assert b.labels.tolist() == [1, 2, 3, 4, 4, 4]
    assert b.target_seq.tolist() == [0, 0, 1, 2, 2, 2] and b.target_offset.tolist() == [0, 1, 0, 0, 1, 2]
    allowed = ~b.attention_mask[0, 0]
    assert allowed[5].tolist() == [True, True, True, False, False, True]  # response 2 sees the prompt, not 1's
    assert allowed[4].tolist() == [True, True, True, True, True, False]
    assert (~b.attention_mask[1, 0])[5].tolist() == [False] * 5 + [True]  # a pad sees only itself


def test_each_response_attends_exactly_as_in_a_row_of_its_own():
    torch.manual_seed(0)
    prompt = torch.arange(4)
    seqs = [torch.cat([prompt, torch.arange(r) + 10]) for r in (3, 1, 5)]
    b = shared_prompt_batch(seqs, [4, 4, 4], [[0, 1, 2]])
    L, d = b.tokens.shape[1], 8
    feats = torch.randn(L, d)  # a feature per row position: the prompt's are shared by construction
    q, k, v = (feats @ torch.randn(d, d) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=~b.attention_mask[0])
    start = 4
    for r in (3, 1, 5):
        idx = torch.cat([torch.arange(4), torch.arange(start, start + r)])
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[idx][None], k[idx][None], v[idx][None], is_causal=True
        )
        torch.testing.assert_close(out[0, idx], alone[0])
        start += r


def test_mask_convention_is_megatrons_and_an_empty_micro_batch_is_a_dummy():
    """megatron-core fills scores where the mask is True (masked out): our mask must hide the future."""
    from megatron.core.transformer.utils import attention_mask_func

    b = shared_prompt_batch([torch.arange(3)], [1], [[0]])
    hidden = attention_mask_func(torch.zeros(1, 1, 3, 3), b.attention_mask) == -10000.0
    assert hidden[0, 0].tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    d = shared_prompt_batch([], [], [])
    assert d.tokens.tolist() == [[0]] and d.target_index.numel() == 0 and d.labels.numel() == 0


def test_groups_and_the_flop_decision():
    prompts = [torch.tensor([1, 2]), torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([1, 2])]
    assert prompt_groups(prompts) == [[0, 1], [2], [3]]
    assert share_prompt(100, [30] * 8, token_flops=1000, attn_flops=1)  # prompt-heavy: share
    assert not share_prompt(10, [5000] * 16, token_flops=1000, attn_flops=1)  # long responses: dense row too costly
    assert not share_prompt(100, [30], token_flops=1000, attn_flops=1)  # nothing to share
    # a shared group larger than the budget is split into rows that fit
    rows = plan_rows([10] * 8, [20] * 8, [list(range(8))], max_tokens=75, token_flops=1000, attn_flops=1)
    assert rows == [[0, 1, 2], [3, 4, 5], [6, 7]]


@pytest.fixture(scope="module")
def actor():
    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.dist import teardown
    from megatron_dapo.config.run_config import load_config

    yield MegatronActor(load_config("demo_cpu", ["train.batch_prompts=4", "train.mini_batch_prompts=4"]))
    teardown()


def test_actor_logprobs_equal_one_row_per_sequence(actor):
    from megatron_dapo.types import Sequence

    g = torch.Generator().manual_seed(1)
    seqs = []
    for _ in range(4):
        prompt = torch.randint(3, 24, (int(torch.randint(5, 12, (1,), generator=g)),), generator=g)
        for _ in range(6):
            resp = torch.randint(3, 24, (int(torch.randint(1, 13, (1,), generator=g)),), generator=g)
            seqs.append(Sequence(torch.cat([prompt, resp]), len(prompt)))
    shared, ent = actor.compute_logprobs(seqs, with_entropy=True)
    assert actor.last_balance.real_tokens < sum(int(s.tokens.numel()) for s in seqs)  # the prompts were shared
    actor.cfg.parallel.share_prompts = False
    try:
        alone, ent_alone = actor.compute_logprobs(seqs, with_entropy=True)
    finally:
        actor.cfg.parallel.share_prompts = True
    for a, b in zip(shared + ent, alone + ent_alone):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
