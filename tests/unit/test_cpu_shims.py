"""The CPU shims for megatron-core: applied only without CUDA, each one a known replacement (function identity)."""

import pytest
import torch

from megatron_dapo.actor import cpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check")
def test_shims_replace_exactly_the_listed_calls_on_cpu():
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as tp_random

    assert cpu.apply_cpu_shims() is True and cpu.shims_applied()
    assert torch.cuda.current_device is cpu._cpu_device
    assert torch.cuda.synchronize is cpu._noop
    assert torch.Tensor.type is cpu._tensor_type_as_cuda
    assert torch.Tensor.cuda is cpu._tensor_stays_on_cpu
    assert torch.cuda.current_stream is cpu._cpu_current_stream and torch.cuda.current_stream().wait_event(None) is None
    assert isinstance(tp_random._CUDA_RNG_STATE_TRACKER, cpu._CpuRngTracker)
    assert isinstance(schedules.torch, cpu._CpuFactoryTorch)
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert torch.ones(2).type() == "torch.cuda.FloatTensor" and torch.ones(2).type(torch.int64).dtype == torch.int64


def test_rng_tracker_fork_is_isolated():
    t = cpu._CpuRngTracker()
    t.add("a", 7)
    before = torch.get_rng_state()
    with t.fork("a"):
        x = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    torch.manual_seed(7)
    assert torch.equal(x, torch.rand(3))  # the fork drew from the seeded stream


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_shim_when_cuda_is_present():
    import megatron.core.pipeline_parallel.schedules as schedules

    real = (
        torch.cuda.current_device,
        torch.cuda.synchronize,
        torch.cuda.current_stream,
        torch.Tensor.type,
        torch.Tensor.cuda,
    )
    assert cpu.apply_cpu_shims() is False and not cpu.shims_applied()
    now = (
        torch.cuda.current_device,
        torch.cuda.synchronize,
        torch.cuda.current_stream,
        torch.Tensor.type,
        torch.Tensor.cuda,
    )
    assert now == real
    assert schedules.torch is torch
