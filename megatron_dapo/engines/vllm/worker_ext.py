"""Runs INSIDE the vLLM server's worker processes (``--worker-extension-cls``; the server's own venv): it imports torch
and the standard library only. vLLM mixes the class into its ``Worker`` (vllm/v1/worker/worker_base.py:296-322) and
``POST /collective_rpc {"method": "dapo_checksums", ...}`` calls the method on every worker
(vllm/entrypoints/serve/dev/rpc/api_router.py:23-59; the route exists with ``VLLM_SERVER_DEV_MODE=1``).

Why our own checksums: vLLM's ``/weight_checker`` hashes the parameters as they are, and on a CPU a linear layer's
weight is emptied once oneDNN (or sgl-kernel) has packed it (``dispatch_cpu_unquantized_gemm(layer,
remove_weight=True)``, vllm/model_executor/layers/utils.py:470-600, from linear.py:216): 8 of the tiny model's 17
tensors hash as empty. Here such a weight is read back through the kernel that serves it: ``cpu_linear`` applied to an
identity matrix returns W^T exactly (each output is one weight times 1 plus zeros), so the hash covers what the
server computes with, not a copy it no longer holds. The hash is ``engines/sglang/layout.server_tensor_hash``'s for a
CPU tensor (the first 8 bytes of the SHA-256 of the raw bytes) of the tensor in the model's dtype, so the expectation
is built by the same ``ServerChecksums`` (vLLM fuses and shards as SGLang does: qkv_proj, gate_up_proj, the vocabulary
padded to 64 rows)."""

from __future__ import annotations

import hashlib

import torch


def _hash(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).digest()[:8].hex()


def _held(module: torch.nn.Module, name: str, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values parameter ``name`` of ``module`` serves with, in ``dtype``."""
    if name == "weight" and param.numel() == 0 and hasattr(module, "cpu_linear"):  # packed on a CPU (see above)
        k = int(getattr(module, "input_size_per_partition", 0) or module.input_size)
        eye = torch.eye(k, dtype=dtype)
        with torch.no_grad():
            return module.cpu_linear(eye, None, None).t().to(dtype)
    return param.to(dtype)


class DapoWorkerExtension:
    """Methods vLLM adds to each worker (``self`` is the worker: ``model_runner``, ``model_config``)."""

    def dapo_checksums(self, names: list[str] | None = None) -> dict:
        """{"tp_rank": r, "dtype": ..., "checksums": {parameter: hash}} of this worker's shard, for ``names`` (all
        when None); a name the model does not have is absent from the answer."""
        from vllm.distributed import get_tensor_model_parallel_rank

        model = self.model_runner.get_model()
        dtype = self.model_config.dtype
        wanted = None if names is None else set(names)
        modules = dict(model.named_modules())
        out = {}
        for full, param in model.named_parameters():
            if wanted is not None and full not in wanted:
                continue
            owner, _, leaf = full.rpartition(".")
            out[full] = _hash(_held(modules[owner], leaf, param, dtype))
        return {"tp_rank": int(get_tensor_model_parallel_rank()), "dtype": str(dtype), "checksums": out}
