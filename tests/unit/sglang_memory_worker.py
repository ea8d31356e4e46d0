"""Run by tests/unit/test_sglang_memory.py in its own process (sglang's import-only stand-ins, tests/sglang_cpu_support,
on its PYTHONPATH; a CPU, no GPU): SGLang 0.5.23's OWN memory arithmetic, the functions that
megatron_dapo/engines/sglang/memory.py cites, called with a mocked GPU. Reads the cases as JSON on stdin, writes
the answers as JSON on stdout's last line.

- server_args: ServerArgs resolved (``resolve_once``) with nvidia-smi's memory.total mocked
  (memory_hook.get_device_memory_capacity) and the CUDA default prefill graph backend ("breakable",
  cuda_graph_config.default_prefill_backend; a CPU would say "disabled"): the mem_fraction, chunk size, CUDA-graph
  sizes SGLang picks, and its graph reserve (memory_hook.reserve_for_graph_mb)
- kv_budget: KVCacheConfigurator._profile_available_bytes with the free memory mocked
- cell: DefaultPoolConfigurator._compute_cell_size on the model's ModelConfig
- pool: DefaultPoolConfigurator.calculate_pool_sizes (bytes -> tokens)
- requests: KVCacheConfigurator.resolve_max_num_reqs
- req_table: a real ReqToTokenPool's bytes (on the CPU), and get_req_to_token_extra_context_len
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace as NS
from unittest import mock

import torch


def server_args(model_dir: str, case: dict) -> dict:
    import sglang.srt.arg_groups.memory_hook as mh
    import sglang.srt.model_executor.cuda_graph_config as cgc
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path=model_dir,
        tp_size=case["tp"],
        mem_fraction_static=case.get("mem_fraction"),
        max_running_requests=case.get("max_running_requests"),
        enable_memory_saver=True,
        device="cuda",
    )
    with (
        mock.patch.object(mh, "get_device_memory_capacity", return_value=float(case["gpu_mib"])),
        mock.patch.object(cgc, "default_prefill_backend", return_value=case.get("prefill_backend", "breakable")),
    ):
        sa.resolve_once()
        graph_mb = mh.reserve_for_graph_mb(sa)
    graphs = resolution_result(sa, "cuda_graph_config")
    return {
        "mem_fraction": resolution_result(sa, "mem_fraction_static"),
        "chunked_prefill_size": resolution_result(sa, "chunked_prefill_size"),
        "decode_max_bs": graphs.decode.max_bs,
        "prefill_backend": graphs.prefill.backend,
        "prefill_sizes": list(graphs.prefill.bs),
        "graph_reserve_mb": graph_mb,
    }


def kv_budget(case: dict) -> int:
    import sglang.srt.mem_cache.kv_cache_configurator as kc

    self = NS(device="cuda", gpu_id=0, mambaish_config=None, post_capture_kv_active=False,
              model_config=NS(is_multimodal=False))  # fmt: skip
    graphs = NS(prefill=NS(full_prefill_max_req=None, backend="disabled"))
    with (
        mock.patch.object(kc, "get_available_gpu_memory", return_value=case["free_after_load_gib"]),
        mock.patch.object(kc, "get_parallel", return_value=NS(launch_world_size=1, world_group=NS(cpu_group=None))),
        mock.patch.object(kc, "get_schedule", return_value=NS(mem_fraction_static=case["mem_fraction"],
                                                              prefill_max_requests=None, max_mamba_cache_size=None)),
        mock.patch.object(kc, "get_exec", return_value=NS(graph=NS(cuda_graph_config=graphs))),
        mock.patch.object(kc, "get_disagg", return_value=NS(disaggregation_mode="null")),
        mock.patch.object(kc, "get_mm", return_value=NS(mm_feature_transport=None)),
    ):  # fmt: skip
        return kc.KVCacheConfigurator._profile_available_bytes(self, case["pre_gib"])


def cell(model_dir: str, tp: int) -> dict:
    import sglang.srt.layers.cp.utils as cp_utils
    import sglang.srt.model_executor.pool_configurator as pc
    from sglang.srt.configs.model_config import ModelConfig

    mc = ModelConfig(model_dir)
    kvc = NS(model_config=mc, kv_cache_dtype=torch.bfloat16, server_args=NS(enable_hisparse=False),
             use_mla_backend=False, device="cuda", page_size=1)  # fmt: skip
    self = object.__new__(pc.DefaultPoolConfigurator)
    self.kv_cache_dtype_str = "auto"
    with (
        mock.patch.object(pc, "get_parallel", return_value=NS(attn_tp_size=tp, attn_dcp_size=1, attn_cp_size=1)),
        mock.patch.object(cp_utils, "is_glm_dsa_cache_layer_split_enabled", return_value=False),
    ):
        return {"cell": self._compute_cell_size(kvc, mc.num_hidden_layers), "context_len": mc.context_len}


def pool(case: dict) -> int:
    import sglang.srt.model_executor.pool_configurator as pc

    self = object.__new__(pc.DefaultPoolConfigurator)
    self._cell_size, self._fixed_overhead_bytes, self._zero_kv_max_tokens = case["cell"], 0, 0
    return self.calculate_pool_sizes(case["bytes"], case["page_size"]).max_total_num_tokens


def requests(case: dict) -> int:
    import sglang.srt.mem_cache.kv_cache_configurator as kc

    self = NS(model_config=NS(context_len=case["context_len"]), attn_dp_size=1, mambaish_config=None)
    with mock.patch.object(kc, "get_schedule", return_value=NS(max_running_requests=case.get("requested"))):
        return kc.KVCacheConfigurator.resolve_max_num_reqs(self, case["tokens"])


def req_table(case: dict) -> dict:
    import sglang.srt.mem_cache.allocation_sizing as sizing
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    with (
        mock.patch.object(sizing, "max_speculative_num_draft_tokens", return_value=None),
        mock.patch.object(sizing, "get_alloc_page_size", return_value=1),
        mock.patch.object(sizing, "get_spec", return_value=NS(speculative_algorithm=None)),
    ):
        extra = sizing.get_req_to_token_extra_context_len()
    table = ReqToTokenPool(size=case["requests"], max_context_len=case["context_len"] + extra, device="cpu",
                           enable_memory_saver=False)  # fmt: skip
    return {"extra": extra, "bytes": table.req_to_token.nbytes}


def main() -> None:
    cases = json.loads(sys.stdin.read())
    d = cases["model_dir"]
    out = {
        "server_args": [server_args(d, c) for c in cases["server_args"]],
        "kv_budget": [kv_budget(c) for c in cases["kv_budget"]],
        "cell": [cell(d, tp) for tp in cases["cell"]],
        "pool": [pool(c) for c in cases["pool"]],
        "requests": [requests(c) for c in cases["requests"]],
        "req_table": [req_table(c) for c in cases["req_table"]],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
