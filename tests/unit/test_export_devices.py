"""PP > 1 export: every tensor a later stage sends lives on the parameters' device (NCCL takes CUDA tensors only).

NCCL cannot run here, so the parameters sit on torch's ``meta`` device and the collectives are recorded: any tensor
made on the CPU instead (the count or dtype codes of the bucket header, say) shows up as a CPU tensor."""

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_dapo.bridge import export
from megatron_dapo.models.arch import ArchConfig
from megatron_dapo.models.registry import table_for

ARCH = ArchConfig(name="t", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  num_query_groups=2, vocab_size=40, tie_embeddings=False)  # fmt: skip


def test_a_later_stage_sends_only_device_tensors(monkeypatch):
    stage1 = [p for p in table_for(ARCH).params(ARCH) if export._stage_of(p, ARCH, 2) == 1]
    local = {p.megatron: torch.empty(p.shape(), device="meta") for p in stage1}
    sent = []
    monkeypatch.setattr(export, "local_parameters", lambda chunks, arch: local)
    monkeypatch.setattr(export, "gather_tp", lambda p, shard, group: shard)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(dist, "send", lambda t, dst: sent.append((t.device.type, dst)))
    for name, value in [("get_data_parallel_rank", 0), ("get_tensor_model_parallel_group", None),
                        ("get_tensor_model_parallel_rank", 0), ("get_pipeline_model_parallel_rank", 1),
                        ("get_pipeline_model_parallel_world_size", 2), ("get_pipeline_model_parallel_group", None)]:  # fmt: skip
        monkeypatch.setattr(ps, name, lambda *a, v=value, **k: v)
    assert list(export._export_items([], ARCH, "rank0")) == []  # a later stage yields nothing: it sends
    assert len(sent) == 2 + len(stage1)  # the header (count, dtype codes), then every parameter
    assert {device for device, _ in sent} == {"meta"} and {dst for _, dst in sent} == {0}
