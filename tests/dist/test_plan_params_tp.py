"""count_params against real megatron-core GPTModels sharded over TP = 2 (torchrun, gloo)."""

import pytest

from megatron_dapo.plan import count_params
from tests.unit.test_plan import MEGATRON_ARCHS, megatron_counts

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def test_count_params_matches_megatron_tp2(tmp_path):
    counts = megatron_counts(tmp_path, MEGATRON_ARCHS, tp=2)
    for arch in MEGATRON_ARCHS:
        for key, n in counts[arch.name].items():
            pp, rank = map(int, key.split("/"))
            assert count_params(arch, 2, pp, rank) == n, (arch.name, key)
