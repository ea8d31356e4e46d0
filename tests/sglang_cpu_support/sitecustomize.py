"""CPU STAND-IN for one SGLang 0.5.23 allocation, for the real server on a CPU in tests and the CPU demos.

This folder goes on the PYTHONPATH of the SERVER process only (``rollout.sglang_pythonpath``), so Python imports this
file at the start of the server and of each process it spawns; never on GPU, never in the trainer.

``--enable-return-routed-experts`` (MoE routing replay) keeps its routes in a host buffer allocated by
``ALLOC_MEMORY_FUNCS[device]`` (sglang/srt/state_capturer/base.py ``BaseHostCache``). The map has no CPU entry, so a
CPU server gets ``alloc_with_host_register`` (sglang/srt/mem_cache/pool_host/common.py), which pins the buffer and
calls ``torch.cuda.cudart()``: it fails without CUDA. On a CPU the buffer is plain host memory already, so the CPU
entry set here allocates it with ``torch.empty``. Nothing else is changed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_TARGET = "sglang.srt.mem_cache.pool_host.common"


def _cpu_alloc(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    import torch

    del pin_memory, allocator, registration_granularity_bytes  # host memory is all a CPU has
    return torch.empty(dims, dtype=dtype, device=device)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        module.ALLOC_MEMORY_FUNCS["cpu"] = _cpu_alloc


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
