"""Per-sequence logprobs (and entropies) from the ranks that computed them to only the ranks that use them.

The last pipeline stage's TP rank 0 of every DP (and CP) rank holds the logprobs of its positions. Each sequence has a
key and each key a set of destination ranks (``route``): rank 0 always (the trainer's metrics read every sequence),
and for the separate π_old pass, the ranks of the DP rank whose later mini-batch trains on the sequence. Every source
sends each destination, per key, one flat byte tensor (positions in the key's flat response space as int32, fp32
logprobs, fp32 entropies) over a gloo group, on the host; a rank receives only what its keys hold.

Not ``all_gather_object`` on the default group: on GPU that group is NCCL, whose object collectives run on the CUDA
device (torch 2.13 torch/distributed/distributed_c10d.py:3500 ``_get_object_coll_device``): each rank's pickle is
copied to the GPU (:3410) and every rank allocates ``world × largest pickle`` bytes there for the result
(:3517-3518) — the whole batch's logprobs, pickled with int64 sequence ids and offsets, on every GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

INDEX_BYTES = 4  # an int32 position in a key's flat response space (a key of 2^31 tokens or more: refused)
VALUE_BYTES = 4  # fp32 logprob, and fp32 entropy when asked


def _pack(pos: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(
        [pos.to(torch.int32).view(torch.uint8)] + [v.float().contiguous().view(torch.uint8) for v in values]
    )


def _unpack(msg: torch.Tensor, n: int, n_values: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    pos = msg[: n * INDEX_BYTES].view(torch.int32).long()
    base = n * INDEX_BYTES
    vals = [
        msg[base + j * n * VALUE_BYTES : base + (j + 1) * n * VALUE_BYTES].view(torch.float32) for j in range(n_values)
    ]
    return pos, vals


def route(
    parts: list[tuple[torch.Tensor, ...]],
    lengths: list[int],
    keys: list[int],
    dests: list[set[int]],
    with_entropy: bool,
    group=None,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Per sequence its [R] fp32 logprobs and entropies on the ranks of ``dests[keys[i]]``; None elsewhere.

    ``parts``: this rank's (sequence index, response offset, logprob, entropy or None) CPU tensors, one tuple per
    micro-batch (none where this rank computed nothing); ``lengths``: every sequence's response length; ``keys[i]``:
    sequence i's key, an index into ``dests`` (the global ranks that receive it). Every rank of ``group`` (gloo; None:
    one process) calls it with the same ``lengths``, ``keys``, ``dests``. Positions no part covers stay 0.
    """
    rank = dist.get_rank() if group is not None else 0
    n_values = 2 if with_entropy else 1
    msg_bytes = INDEX_BYTES + VALUE_BYTES * n_values
    key_of = torch.tensor(keys, dtype=torch.long)
    start = torch.zeros(len(lengths), dtype=torch.long)  # sequence i starts here in its key's flat space
    size = [0] * len(dests)
    for i, (k, n) in enumerate(zip(keys, lengths)):
        start[i], size[k] = size[k], size[k] + n
    if max(size, default=0) >= 2**31:
        raise ValueError(f"logprob gather: a key holds {max(size)} tokens, more than an int32 position addresses")

    # this rank's tokens, one packed message per key
    out: dict[int, torch.Tensor] = {}
    counts = torch.zeros(len(dests), dtype=torch.long)
    if parts:
        seq, off = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        values = [torch.cat([p[2 + j] for p in parts]) for j in range(n_values)]
        tok_key = key_of[seq]
        counts += torch.bincount(tok_key, minlength=len(dests))
        for k in tok_key.unique().tolist():
            sel = tok_key == k
            out[k] = _pack(start[seq[sel]] + off[sel], [v[sel] for v in values])

    # how many tokens of each key every rank sends: a small all-gather
    world, table = 1, counts[None]
    if group is not None:
        world = dist.get_world_size()
        table = torch.zeros(world, len(dests), dtype=torch.long)
        dist.all_gather(list(table.unbind(0)), counts, group=group)

    received: dict[int, list[tuple[int, torch.Tensor]]] = {}  # key -> [(tokens, message)]
    work = []
    for k, members in enumerate(dests):
        for src in range(world) if rank in members else ():
            n = int(table[src, k])
            if n and src == rank:
                received.setdefault(k, []).append((n, out[k]))
            elif n:
                buf = torch.empty(n * msg_bytes, dtype=torch.uint8)
                work.append(dist.irecv(buf, src=src, group=group, tag=k))
                received.setdefault(k, []).append((n, buf))
    for k, msg in out.items():
        for dst in sorted(dests[k] - {rank}):
            work.append(dist.isend(msg, dst=dst, group=group, tag=k))
    for w in work:
        w.wait()
    del out

    lp_out: list[torch.Tensor | None] = [None] * len(lengths)
    ent_out: list[torch.Tensor | None] = [None] * len(lengths)
    for k, members in enumerate(dests):
        if rank not in members:
            continue
        flat = [torch.zeros(size[k]) for _ in range(n_values)]
        for n, msg in received.pop(k, []):
            pos, vals = _unpack(msg, n, n_values)
            for f, v in zip(flat, vals):
                f[pos] = v
        for i in (key_of == k).nonzero().squeeze(-1).tolist():
            span = slice(int(start[i]), int(start[i]) + lengths[i])
            lp_out[i] = flat[0][span].clone()
            ent_out[i] = flat[1][span].clone() if with_entropy else None
    return lp_out, ent_out


def all_gather_small(obj, group=None) -> list:
    """Every rank's small picklable ``obj`` (a few metrics, never per-token data), pickled over the host group."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def dp_rank_members(dp_rank: int, group=None) -> list[list[int]]:
    """Per DP rank, the global ranks that hold it (every rank calls this with its own DP rank)."""
    if group is None:
        return [[0]]
    table = torch.zeros(dist.get_world_size(), 1, dtype=torch.long)
    dist.all_gather(list(table.unbind(0)), torch.tensor([dp_rank]), group=group)
    ranks = table.squeeze(1)
    return [[r for r, d in enumerate(ranks.tolist()) if d == dd] for dd in range(max(ranks.tolist()) + 1)]


@dataclass(frozen=True)
class GatherBytes:
    """Bytes the logprob gather holds at its peak, per rank."""

    device: int  # accelerator bytes: none, it runs on the host over gloo
    driver: int  # rank 0's host bytes: it receives every token
    share: int  # any other rank's host bytes: what it sends, plus its DP rank's share of the tokens
    replaced_device: int  # what all_gather_object on the NCCL default group held on EVERY GPU, for comparison

    @property
    def peak(self) -> int:
        return max(self.driver, self.share)


def logprob_gather_bytes(
    tokens: int, *, dp: int, tp: int = 1, pp: int = 1, cp: int = 1, with_entropy: bool = True
) -> GatherBytes:
    """The peak bytes of one logprob gather of ``tokens`` response tokens (the π_old pass or the first mini-batch's
    forward) on a layout of DP × TP × PP × CP ranks, with the tokens balanced over the DP (and CP) ranks.

    A token takes ``m = INDEX_BYTES + v`` bytes in a message and ``v = VALUE_BYTES × (2 with entropies, else 1)`` in
    the per-sequence results and again in the unpacking buffer of one key. Rank 0 receives every token and keeps them all: its messages
    (its own chunk among them), the results, and at most every token in the unpacking buffer: ``(m + 2v) × tokens``.
    Another rank holds the messages it sends (its DP and CP rank's positions, ``tokens / (DP × CP)``, once: the same
    buffer goes to every destination) and receives its DP rank's share: ``m × tokens/(DP·CP) + (m + 2v) × tokens/DP``.
    TP and PP change only which ranks send (the last stage's TP rank 0), not these bounds.

    ``replaced_device`` models the all_gather_object it replaces: every rank's pickle of (int64 sequence id, int64
    offset, fp32 logprob, fp32 entropy) per token, padded to the largest, ``world`` of them plus its own on every GPU.
    """
    values = VALUE_BYTES * (2 if with_entropy else 1)
    msg = INDEX_BYTES + values
    per_sender = -(-tokens // (dp * cp))
    per_dp = -(-tokens // dp)
    world = dp * tp * pp * cp
    return GatherBytes(
        device=0,
        driver=(msg + 2 * values) * tokens,
        share=msg * per_sender + (msg + 2 * values) * per_dp if world > 1 else 0,
        replaced_device=(world + 1) * 24 * per_sender if world > 1 else 0,
    )
