"""Rows in which a group's responses share one copy of their prompt (the local spec's micro-batch layout).

GRPO/DAPO samples G responses per prompt, so a batch holds every prompt G times. Here one row holds the prompt once
and then the responses of its group one after the other::

    row:       P P P P | a a a | b b b b | c c            (prompt 4 tokens, 3 responses)
    position:  0 1 2 3 | 4 5 6 | 4 5 6 7 | 4 5            (each response continues the prompt's positions)
    attends:   prompt tokens causally; a response token: the whole prompt and its own response causally

so every response sees exactly what it sees in a row of its own — the same keys, the same RoPE positions — and the
logprobs and gradients are those of separate rows (to fp32 rounding), while the prompt is computed once instead of
G times. The token that predicts a response's first token is the prompt's last one, shared by the group: targets are
therefore listed explicitly (``target_index``: which hidden state predicts each response token), not as "position t
predicts t + 1". Rows are right-padded to the longest; a pad attends only to itself.

Whether a group is worth sharing is a FLOP estimate (``share_prompt``): a shared row saves (G − 1)·p tokens of
the model's per-token work but its dense attention spans the whole row; long responses behind a short prompt are
cheaper in rows of their own. A row never exceeds the micro-batch budget: a group that does not fit is split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def prompt_groups(prompts: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of consecutive sequences with identical prompt tokens (how the trainer lays out a group)."""
    groups: list[list[int]] = []
    for i, p in enumerate(prompts):
        if groups and torch.equal(prompts[groups[-1][0]], p):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def share_prompt(prompt_len: int, response_lens: Sequence[int], token_flops: float, attn_flops: float) -> bool:
    """True when one shared row costs fewer FLOPs than a row per response. ``token_flops``: the model's work per
    token outside attention; ``attn_flops``: attention work per (query, key) pair."""
    separate = sum((prompt_len + r) * token_flops + (prompt_len + r) ** 2 * attn_flops for r in response_lens)
    length = prompt_len + sum(response_lens)
    return len(response_lens) > 1 and length * token_flops + length**2 * attn_flops < separate


def plan_rows(
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    groups: Sequence[Sequence[int]],
    max_tokens: int,
    token_flops: float,
    attn_flops: float,
) -> list[list[int]]:
    """Rows of sequence indices: each group shared where ``share_prompt`` says so, split into rows of at most
    ``max_tokens`` tokens (prompt once plus the responses); otherwise one row per sequence."""
    rows: list[list[int]] = []
    for g in groups:
        p = prompt_lens[g[0]]
        if not share_prompt(p, [response_lens[i] for i in g], token_flops, attn_flops):
            rows += [[i] for i in g]
            continue
        row: list[int] = []
        for i in g:
            if row and p + sum(response_lens[j] for j in row) + response_lens[i] > max_tokens:
                rows.append(row)
                row = []
            row.append(i)
        rows.append(row)
    return rows


@dataclass
class SharedPromptBatch:
    """[B, L] rows (see the module docstring) and one target per response token, in sequence order."""

    tokens: torch.Tensor  # [B, L]
    position_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, 1, L, L] bool, True = masked out (megatron-core's convention)
    target_index: torch.Tensor  # [N] index into the flattened [B·L] hidden states
    target_seq: torch.Tensor  # [N] which of the sequences (their order in the call)
    target_offset: torch.Tensor  # [N] response token offset within its sequence
    labels: torch.Tensor  # [N] the response tokens

    @property
    def total_tokens(self) -> int:
        return self.tokens.numel()


def shared_prompt_batch(
    tokens: Sequence[torch.Tensor], prompt_lens: Sequence[int], rows: Sequence[Sequence[int]], pad_id: int = 0
) -> SharedPromptBatch:
    """Lay out ``rows`` (lists of indices into ``tokens``; a row's sequences share their prompt) as a batch. An empty
    ``rows`` gives the one-token dummy of an empty micro-batch (no targets). Built in Python lists, one tensor each."""
    if not rows:
        rows, tokens, prompt_lens = [[0]], [torch.full((1,), pad_id, dtype=torch.long)], [1]
    lists = {i: tokens[i].tolist() for r in rows for i in r}
    width = max(prompt_lens[r[0]] + sum(len(lists[i]) - prompt_lens[i] for i in r) for r in rows)
    out, pos, seg = [], [], []  # seg: -1 prompt, j >= 0 response j, -2 padding
    index, seq, offset, labels = [], [], [], []
    for b, row in enumerate(rows):
        p = prompt_lens[row[0]]
        t, q, s = lists[row[0]][:p], list(range(p)), [-1] * p
        for j, i in enumerate(row):
            resp = lists[i][p:]
            r = len(resp)
            # response token k is predicted by the hidden state before it: the prompt's last one for k = 0
            index += [b * width + p - 1] + [b * width + len(t) + k for k in range(r - 1)] if r else []
            seq += [i] * r
            offset += range(r)
            labels += resp
            t += resp
            q += range(p, p + r)
            s += [j] * r
        pad = width - len(t)
        out.append(t + [pad_id] * pad)
        pos.append(q + [0] * pad)
        seg.append(s + [-2] * pad)
    seg_t = torch.tensor(seg)
    qs, ks = seg_t[:, :, None], seg_t[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = ((ks == -1) & ((qs >= 0) | ((qs == -1) & causal))) | ((qs == ks) & (qs >= 0) & causal)
    allowed |= torch.eye(width, dtype=torch.bool)  # every token sees itself: a pad only itself, no empty row
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return SharedPromptBatch(
        tokens=as_long(out),
        position_ids=as_long(pos),
        attention_mask=~allowed[:, None],
        target_index=as_long(index),
        target_seq=as_long(seq),
        target_offset=as_long(offset),
        labels=as_long(labels),
    )
