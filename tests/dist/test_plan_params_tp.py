"""The planner's parameter / gradient / optimizer accounting against real MegatronActors at several TP/PP sizes."""

import json
from pathlib import Path

import pytest

from megatron_dapo.config import load_arch
from megatron_dapo.plan import count_params
from tests.helpers import REPO, run_torchrun

WORKER = Path(__file__).with_name("plan_actor_worker.py")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def _untied(tmp_path) -> Path:
    path = tmp_path / "tiny-untied.yaml"
    text = (REPO / "model_configs" / "tiny.yaml").read_text()
    path.write_text(
        text.replace("tie_embeddings: true", "tie_embeddings: false").replace("name: tiny", "name: tiny-untied")
    )
    return path


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_planner_bytes_equal_real_actor(tmp_path, tp, pp):
    """Tied and untied embeddings (both in one launch of TP x PP ranks)."""
    paths = [REPO / "model_configs" / "tiny.yaml", _untied(tmp_path)]
    out = tmp_path / "rows.json"
    run_torchrun(tp * pp, WORKER, out, ",".join(map(str, paths)), tp, pp, timeout=300)
    result = json.loads(out.read_text())
    assert sorted(result) == sorted(map(str, paths))
    for path in paths:
        arch, rows = load_arch(path), result[str(path)]
        assert len(rows) == tp * pp
        for r in rows:
            n = count_params(arch, tp, pp, r["pp_rank"])
            assert r["params"] == n, (path.name, r)
            # fp32 on CPU: 4 B weights, 4 B gradients (grad_reduce_in_fp32 buffers), Adam's two fp32 moments = 8 B.
            # (The planner's 12 B optimizer figure adds the fp32 master copy that bf16 training keeps.)
            assert r["param_bytes"] == 4 * n
            assert r["grad_bytes"] == 4 * n
            assert r["optimizer_bytes"] == 8 * n
