"""megatron-core's model-parallel groups (the export's TP gathers, the PP exchange) get ``parallel.collective_timeout_s``
like the default group, not megatron-core's own 30-minute default."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from megatron_dapo.actor.dist import init_distributed
from megatron_dapo.config.run_config import ParallelConfig


def test_model_parallel_groups_take_the_collective_timeout(monkeypatch):
    from megatron.core import parallel_state

    seen = []
    real_new_group = dist.new_group

    def spy(*args, **kwargs):
        seen.append(kwargs.get("timeout"))
        return real_new_group(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", spy)
    try:
        init_distributed(ParallelConfig(), timeout_s=90.0)
        # the groups megatron-core times itself (None: torch's default for a group, left as megatron leaves it)
        assert set(seen) - {None} == {datetime.timedelta(seconds=90)}, seen
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
