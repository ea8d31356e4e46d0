"""CPU STAND-IN for one SGLang 0.5.23 allocation, for the real server on a CPU in tests and the CPU demos.

This folder goes on the PYTHONPATH of the SERVER process only (``rollout.sglang.pythonpath``), so Python imports this
file at the start of the server and of each process it spawns; never on GPU, never in the trainer.

``--enable-return-routed-experts`` (MoE routing replay) keeps its routes in a host buffer allocated by
``ALLOC_MEMORY_FUNCS[device]`` (sglang/srt/state_capturer/base.py ``BaseHostCache``). The map has no CPU entry, so a
CPU server gets ``alloc_with_host_register`` (sglang/srt/mem_cache/pool_host/common.py), which pins the buffer and
calls ``torch.cuda.cudart()``: it fails without CUDA. On a CPU the buffer is plain host memory already, so the CPU
entry set here allocates it with ``torch.empty``.

LoRA (``--enable-lora --lora-backend torch_native``, the only backend that runs without Triton): SGLang's LoRA layers
and its torch backend pin host tensors unconditionally (sglang/srt/lora/layers.py, ``torch.tensor(...,
pin_memory=True)``; sglang/srt/lora/backend/torch_backend.py ``prepare_lora_batch``, ``.pin_memory()``), which a CPU
build of torch refuses. Pinning exists for faster copies to a GPU; on a CPU the tensor already is where it is used.
When either module is first imported, pinning becomes a no-op in the server process (``Tensor.pin_memory`` returns
the tensor; ``pin_memory=True`` is dropped from ``torch.tensor``/``zeros``/``empty``/``ones``). Nothing else is
changed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_TARGET = "sglang.srt.mem_cache.pool_host.common"
_PINNING = ("sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend")


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
        if module.__name__ in _PINNING:
            _no_pinning()
        self.inner.exec_module(module)
        if module.__name__ == _TARGET:
            module.ALLOC_MEMORY_FUNCS["cpu"] = _cpu_alloc


def _no_pinning() -> None:
    import functools

    import torch

    if torch.cuda.is_available() or getattr(torch, "_dapo_no_pinning", False):
        return
    torch._dapo_no_pinning = True
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    for name in ("tensor", "zeros", "empty", "ones"):
        factory = getattr(torch, name)

        @functools.wraps(factory)
        def unpinned(*args, _factory=factory, **kwargs):
            kwargs.pop("pin_memory", None)
            return _factory(*args, **kwargs)

        setattr(torch, name, unpinned)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET and fullname not in _PINNING:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
