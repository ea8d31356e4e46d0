"""The planner's parameter / gradient / optimizer accounting against real MegatronActors at several TP/PP sizes."""

import json
from pathlib import Path

import pytest

from megatron_dapo.models.arch import load_arch
from megatron_dapo.models.memory import actor_memory
from megatron_dapo.models.memory import count_params
from megatron_dapo.planning.planner import evaluate_layout
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
        # the two accountings under test: the actor's micro-batch budget (memory.actor_memory, fp32 here: 4 B weights,
        # 4 B grad_reduce_in_fp32 buffers, Adam's two fp32 moments 8 B) and `dapo plan`'s (plan.evaluate_layout:
        # bf16 weights and a 12 B optimizer with the fp32 master copy; its gradient term is fp32 as here). Both are
        # of stage 0; the last stage is counted by the planner's count_params.
        budget = actor_memory(arch, 256, 28, dtype_bytes=4, tp=tp, pp=pp)
        planned = evaluate_layout(arch, 16, 12, 1, tp * pp, 80, tp=tp, pp=pp, cp=1, micro_batch_tokens=256,
                                  distributed_optimizer=False).memory  # fmt: skip
        for r in rows:
            assert r["params"] == count_params(arch, tp, pp, r["pp_rank"]), (path.name, r)
            if r["pp_rank"] != 0:
                continue
            assert planned.stage == 0 and r["params"] == planned.params, (path.name, r)
            assert (r["param_bytes"], r["grad_bytes"], r["optimizer_bytes"]) == (
                budget.weights,
                budget.grads,
                budget.optimizer,
            ), (path.name, r)
            assert r["grad_bytes"] == planned.grads and r["param_bytes"] == 2 * planned.weights  # fp32 vs bf16
            assert planned.optimizer == 12 * r["params"]  # the planner's bf16 optimizer: master + 2 moments
