"""HF ⇄ Megatron bridge, the machinery (the per-family mapping tables are in models/): TP/PP resharding, streaming
conversion, live export.

split_model(full, arch, tp, pp) / gather_model(...)    # offline TP/PP shards
hf_to_megatron(hf_dir, out_dir) / megatron_to_hf(ckpt_dir, out_dir, hf_template=...)
export_hf_tensors(model_chunks, arch)                  # weight sync: buckets of (hf_name, full tensor)
"""

from megatron_dapo.bridge.convert import hf_to_megatron, read_meta, write_meta
from megatron_dapo.bridge.convert_to_hf import megatron_to_hf
from megatron_dapo.bridge.export import export_hf_tensors, local_parameters
from megatron_dapo.bridge.reshard import gather_model, gather_tp, merge_tp, split_model, split_tp, stage_of_layer

__all__ = [
    "export_hf_tensors",
    "gather_model",
    "gather_tp",
    "hf_to_megatron",
    "local_parameters",
    "megatron_to_hf",
    "merge_tp",
    "read_meta",
    "split_model",
    "split_tp",
    "stage_of_layer",
    "write_meta",
]
