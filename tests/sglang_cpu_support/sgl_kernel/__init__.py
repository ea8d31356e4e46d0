"""IMPORT-ONLY STAND-IN for ``sgl_kernel`` (sglang-kernel), for the real SGLang 0.5.23 server on a CPU in tests.

PyPI's sglang-kernel / sgl-kernel wheels are CUDA-only builds (no CPU ``common_ops``; importing them fails on
``libcuda.so.1``). SGLang's CPU path (``--device cpu``, ``SGLANG_USE_CPU_ENGINE=1``, torch_native attention) does
not call sgl_kernel for a dense model on a CPU without AMX, but imports these names at start-up. This folder goes on
the PYTHONPATH of the SERVER process only (``rollout.sglang.pythonpath``); never on GPU, never in the trainer.

One name is called and implemented here in torch; every other one raises NotImplementedError when called.
"""

from __future__ import annotations


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = out_cache_loc[<i's slice>]``, the slices
    of ``out_cache_loc`` laid end to end in batch order (the triton kernel ``assign_req_to_token_pool`` does the same).

    Needed by: ``from sgl_kernel import assign_req_to_token_pool_cpu`` in sglang/srt/mem_cache/allocation.py
    (called for every prefill and decode batch on CPU)."""
    del pool_len  # == req_to_token.shape[1]
    starts, ends = start_offset.tolist(), end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _not_implemented(name: str, needed_by: str):
    def stub(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: not implemented by the CPU test stand-in (imported by {needed_by}); "
            "this server configuration needs the real CPU build of sgl-kernel"
        )

    stub.__name__ = name
    return stub


# name -> the SGLang 0.5.23 module whose import needs it
_IMPORTED_ONLY = {
    "copy_all_layer_kv_cache_cpu": "sglang/kernels/ops/kvcache/cache_move.py",  # HiCache / KV moves only
    "assign_draft_cache_locs_contiguous_cpu": "sglang/kernels/ops/speculative/cache_locs.py",  # speculative
    "assign_extend_cache_locs_cpu": "sglang/kernels/ops/speculative/cache_locs.py",  # speculative decoding
    "rotate_input_ids_cpu": "sglang/kernels/ops/speculative/multi_layer_eagle.py",  # speculative decoding
    "fill_accept_out_cache_loc_cpu": "sglang/kernels/ops/speculative/eagle.py",  # speculative decoding
    "fill_bonus_tokens_cpu": "sglang/kernels/ops/speculative/eagle.py",  # speculative decoding
    "build_tree_kernel_efficient_cpu": "sglang/kernels/ops/speculative/spec_tree.py",  # speculative decoding
    "verify_tree_greedy_cpu": "sglang/kernels/ops/speculative/spec_tree.py",  # speculative decoding
    "build_draft_decode_metadata_cpu": "sglang/srt/layers/attention/intel_amx_backend.py",  # AMX backend only
}
for _name, _needed_by in _IMPORTED_ONLY.items():
    globals()[_name] = _not_implemented(_name, _needed_by)
