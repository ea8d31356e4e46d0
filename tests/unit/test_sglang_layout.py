"""The SGLang parameter layout the weight-sync verification rebuilds (sglang_layout.py), on rules the real server
cannot show on a CPU: KV heads replicated when TP exceeds them (the rest is checked against real servers, TP 1 and 2,
in tests/sglang/)."""

import pytest
import torch

from megatron_dapo.engines.sglang.layout import ServerChecksums, server_tensor_hash
from megatron_dapo.types import WeightSyncError


def rows(n: int, width: int = 3, start: float = 0.0) -> torch.Tensor:
    return (start + torch.arange(n * width, dtype=torch.float32)).reshape(n, width)


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    rec = ServerChecksums(torch.float32, "cpu", tp_size=4, head_dim=2)
    q, k, v = rows(8), rows(4, start=100), rows(4, start=200)  # 4 query heads, 2 KV heads of dim 2
    shards = rec._shards("model.layers.0.self_attn.qkv_proj.weight", (q, k, v))
    # SGLang 0.5.23 sglang/srt/layers/linear.py QKVParallelLinear: tp 4 >= 2 KV heads gives num_kv_heads = 1 and
    # num_kv_head_replicas = 4 / 2 = 2 per rank (:1140-1142); the weight loader takes q shard tp_rank and k/v shard
    # kv_tp_rank // num_kv_head_replicas (:1499-1502). Written out: ranks 0, 1 hold KV head 0; ranks 2, 3 KV head 1.
    want = [
        [q[0:2], k[0:2], v[0:2]],  # rank 0: query head 0, KV head 0
        [q[2:4], k[0:2], v[0:2]],  # rank 1: query head 1, KV head 0
        [q[4:6], k[2:4], v[2:4]],  # rank 2: query head 2, KV head 1
        [q[6:8], k[2:4], v[2:4]],  # rank 3: query head 3, KV head 1
    ]
    assert len(shards) == 4
    for rank, (shard, parts) in enumerate(zip(shards, want)):
        assert torch.equal(shard, torch.cat(parts)), rank


def test_split_rules_per_kind():
    rec = ServerChecksums(torch.float32, "cpu", tp_size=2, head_dim=2)
    down = rows(4, width=6)
    assert [s.shape for s in rec._shards("model.layers.0.mlp.down_proj.weight", (down,))] == [(4, 3), (4, 3)]
    gate, up = rows(4), rows(4, start=50)
    g0, g1 = rec._shards("model.layers.0.mlp.gate_up_proj.weight", (gate, up))
    assert torch.equal(g0, torch.cat([gate[:2], up[:2]])) and torch.equal(g1, torch.cat([gate[2:], up[2:]]))
    embed = rows(70)  # padded with zero rows to 128 (a multiple of 64), 64 rows per rank
    e0, e1 = rec._shards("model.embed_tokens.weight", (embed,))
    assert e0.shape == e1.shape == (64, 3) and torch.equal(e1[:6], embed[64:]) and not e1[6:].any()
    norm = torch.ones(3)
    assert all(torch.equal(s, norm) for s in rec._shards("model.norm.weight", (norm,)))


def test_fused_parts_are_hashed_once_complete_and_named():
    rec = ServerChecksums(torch.bfloat16, "cpu")
    rec.add("model.layers.0.self_attn.k_proj.weight", rows(2))
    rec.add("model.layers.0.self_attn.q_proj.weight", rows(4))
    with pytest.raises(
        WeightSyncError, match=r"qkv_proj.weight' on the server fuses 3 HF tensors but only slots \[0, 1\]"
    ):
        rec.result()
    rec.add("model.layers.0.self_attn.v_proj.weight", rows(2, start=9))
    key = ("model.layers.0.self_attn.qkv_proj.weight", 0)
    want = torch.cat([rows(4), rows(2), rows(2, start=9)]).to(torch.bfloat16)
    assert rec.result() == {key: server_tensor_hash(want)}
    assert rec.describe(key).startswith("'model.layers.0.self_attn.q_proj.weight' + ")
    assert server_tensor_hash(want) != server_tensor_hash(want.flip(0)) and len(server_tensor_hash(want)) == 16
