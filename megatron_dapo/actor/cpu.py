"""The ONLY place where megatron-core is adapted to run without CUDA.

megatron-core hard-codes CUDA in a few calls that are on our path. ``apply_cpu_shims()`` patches exactly those, and only
when ``torch.cuda.is_available()`` is False; on a GPU machine it does nothing (tests check the function identities).
Each shim names the upstream call it covers. Everything else is configuration (local layer spec, no fusions, gloo).
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch

_APPLIED = False


def shims_applied() -> bool:
    return _APPLIED


def _cpu_device(*_args, **_kwargs) -> str:
    return "cpu"


def _noop(*_args, **_kwargs) -> None:
    return None


class _CpuRngTracker:
    """Stands in for ``tensor_parallel.random.CudaRNGStatesTracker`` (which saves/restores CUDA generator states).

    Attention enters ``get_cuda_rng_tracker().fork()`` even with dropout 0, and weight init forks the
    "model-parallel-rng" state; here each named state is a CPU generator state, swapped in and out of the default one.
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_.clear()
        self.seeds_.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise RuntimeError(f"rng state {name!r} / seed {seed} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name!r} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


class _CpuFactoryTorch(types.ModuleType):
    """A view of the ``torch`` module whose tensor factories turn ``device="cuda"`` into the CPU.

    Installed as the ``torch`` global of the few megatron modules that allocate with a literal ``device="cuda"``.
    """

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "zeros_like", "ones_like", "empty_like")

    def __init__(self, real) -> None:
        super().__init__("torch")
        self._real = real

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name in self._FACTORIES:

            @functools.wraps(attr)
            def factory(*args, **kwargs):
                device = kwargs.get("device")
                if device is not None and "cuda" in str(device):
                    kwargs["device"] = "cpu"
                return attr(*args, **kwargs)

            return factory
        return attr


_REAL_TENSOR_TYPE = torch.Tensor.type


def _tensor_type_as_cuda(self, dtype=None, non_blocking=False, **kwargs):
    """``Tensor.type()`` with no argument reports ``torch.cuda.*`` names for CPU tensors (see the shim below)."""
    if dtype is None and not kwargs:
        name = _REAL_TENSOR_TYPE(self)
        return name.replace("torch.", "torch.cuda.", 1) if not self.is_cuda else name
    return _REAL_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


def _tensor_stays_on_cpu(self, *_args, **_kwargs):
    return self


class _CpuStream:
    """Stands in for ``torch.cuda.current_stream()``: on a CPU every op has finished when it returns."""

    def wait_event(self, _event) -> None:
        return None

    def wait_stream(self, _stream) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, _event=None) -> _CpuEvent:
        return _CpuEvent()


class _CpuEvent:
    """Stands in for a ``torch.cuda.Event`` recorded on the CPU stream: already complete."""

    def synchronize(self) -> None:
        return None

    def wait(self, _stream=None) -> None:
        return None

    def query(self) -> bool:
        return True


_CPU_STREAM = _CpuStream()


def _split_sizes_on_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` for CPU tensors: upstream returns a CPU tensor as is, ignoring
    ``as_numpy``; the alltoall dispatcher asks for numpy split sizes (token_dispatcher.py ``_maybe_dtoh_and_synchronize``)
    and hands them to ``all_to_all_single`` as Python sizes."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _cpu_current_stream(*_args, **_kwargs) -> _CpuStream:
    return _CPU_STREAM


def apply_cpu_shims() -> bool:
    """Patch the CUDA-only calls megatron-core makes on our path. Returns True if shims were (already) applied."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    import megatron.core.utils as core_utils

    # torch.cuda.current_device(): rotary embeddings (RotaryEmbedding.get_freqs_non_repeated), the global memory
    # buffer and parallel_state allocate on it.
    torch.cuda.current_device = _cpu_device
    # torch.cuda.synchronize(): p2p_communication._p2p_ops (PP with batch_p2p_comm) and dist_checkpointing save.
    torch.cuda.synchronize = _noop
    # tensor_parallel.random.get_cuda_rng_tracker(): CudaRNGStatesTracker saves/restores CUDA generator states.
    tp_random._CUDA_RNG_STATE_TRACKER = _CpuRngTracker()
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # torch.zeros/tensor(..., device="cuda"): schedules.forward_backward_* (total_num_tokens), clip_grads
    # (get_grad_norm_fp32, count_zeros_fp32), optimizer (MixedPrecisionOptimizer found_inf / _scale_one), utils
    # (local_multi_tensor_l2_norm, the fallback of apex's multi_tensor_l2norm).
    for module in (schedules, clip_grads, optimizer, core_utils):
        module.torch = _CpuFactoryTorch(torch)
    # torch.cuda.current_stream(): megatron-core 0.19 _ParamAndGradBucketGroup.start_grad_sync
    # (distributed/param_and_grad_buffer.py:632) waits on CUDA-graph events on it in every DDP grad sync.
    torch.cuda.current_stream = _cpu_current_stream
    # Tensor.type(): clip_grads.clip_grad_by_total_norm_fp32 asserts 'torch.cuda.FloatTensor' and
    # Float16OptimizerWithFloat16Params sorts params by 'torch.cuda.*Tensor' names.
    torch.Tensor.type = _tensor_type_as_cuda
    # Tensor.cuda(): LanguageModule.setup_embeddings_and_output_layer moves the tied embedding copy of the last
    # pipeline stage to CUDA before all-reducing it with the first stage's (PP > 1 with tied embeddings).
    torch.Tensor.cuda = _tensor_stays_on_cpu
    # MoE. moe_utils imports te_general_gemm inside a try that fails without TE, and RouterGatingLinearFunction reads it
    # anyway (moe_utils.py: `if te_general_gemm is not None and router_dtype != torch.float64`): a NameError.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # MoEAlltoAllTokenDispatcher.__init__ creates its device-to-host stream once, class-wide: `torch.cuda.Stream()`
    # (token_dispatcher.py); on the CPU stream current_stream() == it, so its copies run inline.
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _CPU_STREAM
    token_dispatcher.maybe_move_tensor_to_cpu = _split_sizes_on_cpu
    # Full recompute: CheckpointFunction saves and restores every RNG state around the recomputed forward
    # (tensor_parallel/random.py _get_all_rng_states / _set_all_rng_states): the CPU one and the tracker's stay; the
    # CUDA generator's (_get_cuda_rng_state: torch.cuda.random.get_rng_state) does not exist here.
    tp_random._get_cuda_rng_state = _noop
    tp_random._set_cuda_rng_state = _noop
    _APPLIED = True
    return True
