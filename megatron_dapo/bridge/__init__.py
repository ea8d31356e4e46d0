"""HF ⇄ Megatron bridge: declarative mappings per family, TP/PP resharding, streaming conversion, live export.

table_for(arch).hf_to_megatron(hf_state_dict, arch)   # full canonical Megatron tensors
split_model(full, arch, tp, pp) / gather_model(...)    # offline TP/PP shards
hf_to_megatron(hf_dir, out_dir) / megatron_to_hf(ckpt_dir, out_dir, hf_template=...)
export_hf_tensors(model_chunks, arch)                  # weight sync: buckets of (hf_name, full tensor)
"""

from megatron_dapo.bridge.convert import hf_to_megatron, megatron_to_hf, read_meta, write_meta
from megatron_dapo.bridge.export import export_hf_tensors, local_parameters
from megatron_dapo.bridge.mappings import TABLES, MappingTable, canonical_name, checkpoint_key, spec_name, table_for
from megatron_dapo.bridge.reshard import gather_model, gather_tp, merge_tp, split_model, split_tp, stage_of_layer

__all__ = [
    "TABLES",
    "MappingTable",
    "canonical_name",
    "checkpoint_key",
    "export_hf_tensors",
    "gather_model",
    "gather_tp",
    "hf_to_megatron",
    "local_parameters",
    "megatron_to_hf",
    "merge_tp",
    "read_meta",
    "spec_name",
    "split_model",
    "split_tp",
    "stage_of_layer",
    "table_for",
    "write_meta",
]
