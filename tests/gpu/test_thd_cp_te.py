"""Our THD context-parallel index (actor/thd_cp.py) equals Transformer Engine's own CUDA kernel
(``tex.thd_get_partitioned_indices``, what megatron-core 0.16.1 called) on random packed rows. Skipped without CUDA or
TE; never run yet (no GPU was lent to the session that wrote it)."""

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
tex = pytest.importorskip("transformer_engine_torch", reason="needs Transformer Engine")

from megatron_dapo.actor.thd_cp import thd_partitioned_indices  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_index_equals_te_kernel(cp):
    rng = random.Random(cp)
    for _ in range(50):
        lengths = [2 * cp * rng.randint(0, 64) for _ in range(rng.randint(1, 12))]
        lengths[0] = max(lengths[0], 2 * cp)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        total = int(cu[-1])
        for rank in range(cp):
            theirs = tex.thd_get_partitioned_indices(cu, total, cp, rank)
            ours = thd_partitioned_indices(cu, total, cp, rank)
            assert torch.equal(ours.to(theirs.dtype), theirs), (lengths, rank)
