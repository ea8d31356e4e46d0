"""Engine placement and weight-sync routes: one dp=1 engine per rollout-TP group, fed only from its own node."""

import pytest

from megatron_dapo.launch.placement import PlacementError, make_placement


def test_32b_recipe_on_16_nodes():
    p = make_placement(nodes=16, gpus_per_node=8, tp=8, pp=2, cp=1, rollout_tp=4)
    assert (p.world, p.dp, len(p.engines)) == (128, 8, 32)
    assert [(e.node, e.base_gpu_id) for e in p.engines[:4]] == [(0, 0), (0, 4), (1, 0), (1, 4)]
    for r in p.routes:  # every engine is fed by the trainer ranks on its own GPUs, all on its own node
        e = p.engines[r.engine]
        assert r.transport == "cuda_ipc" and len(r.senders) == e.tp
        assert {p.node_of(s) for s in r.senders} == {e.node}
        assert [s % 8 for s in r.senders] == list(e.gpus)
    assert sorted(s for r in p.routes for s in r.senders) == list(range(128))  # each rank feeds exactly one engine
    assert p.pp_exchange and "gather every pipeline stage" in p.explain()
    # megatron's order: tensor fastest; rank 8 is the first rank of the next TP group
    assert p.coords(8) == {"tp": 0, "cp": 0, "dp": 1, "pp": 0} and p.coords(64)["pp"] == 1


def test_disaggregated_engines_on_the_rollout_nodes_over_nccl():
    p = make_placement(nodes=4, gpus_per_node=8, tp=4, pp=1, cp=1, rollout_tp=8, colocated=False, rollout_nodes=1)
    assert p.world == 24 and [e.node for e in p.engines] == [3]
    assert p.routes[0].transport == "nccl" and p.routes[0].senders == (0,)


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(rollout_tp=3), "rollout.sglang.tp = 3: must divide cluster.gpus_per_node"),
        (dict(tp=8, pp=3), "parallel.tp × pp × cp = 8×3×1: must divide the 16 training GPUs"),
        (dict(colocated=False, rollout_nodes=2), "cluster.rollout_nodes = 2"),
    ],
)
def test_impossible_layouts_name_the_setting(kw, needle):
    args = dict(nodes=2, gpus_per_node=8, tp=8, pp=1, cp=1, rollout_tp=4) | kw
    with pytest.raises(PlacementError, match=needle.replace("×", ".").replace("(", r"\(")):
        make_placement(**args)
