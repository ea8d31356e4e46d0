"""``RolloutDriver.resync``: a server restarted mid-rollout gets the current weights from rank 0, or the run stops with
a clear error where rank 0 cannot send them alone (the refusal branches; the resync itself runs against a real SGLang
server in tests/sglang/test_trainer_sglang.py)."""

from types import SimpleNamespace

import pytest

from megatron_dapo.config.run_config import load_config
from megatron_dapo.loop import rollout as driver_mod
from megatron_dapo.loop.rollout import RolloutDriver
from megatron_dapo.types import RolloutError


class FakeSync:
    def __init__(self):
        self.calls = []

    def sync(self, buckets, version, workers=None):
        self.calls.append((buckets, version, workers))
        return SimpleNamespace(version=version, tensors=3, seconds=0.0, verified=3)


def _driver(tp=1, pp=1, node_url=None, *extra, adapters_only=False):
    cfg = load_config("demo_cpu", [f"parallel.tp={tp}", f"parallel.pp={pp}", *extra])
    node_sync = SimpleNamespace(route=SimpleNamespace(url=node_url)) if node_url else None
    return SimpleNamespace(cfg=cfg, node_sync=node_sync, actor=SimpleNamespace(model=["model"]), arch=None,
                           sync=FakeSync(), engine=SimpleNamespace(weight_version=7),
                           adapters_only=adapters_only)  # fmt: skip


@pytest.fixture
def world(monkeypatch):
    """Pretend to be rank 0 of ``size`` ranks; the export returns a marker instead of tensors."""

    def set_world(size):
        fake = SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda: size)
        monkeypatch.setattr(driver_mod, "dist", fake)

    import megatron_dapo.bridge.export as export

    monkeypatch.setattr(export, "export_hf_tensors", lambda model, arch, bucket_bytes: ["buckets of", model])
    return set_world


def server(url):
    return SimpleNamespace(url=url)


def test_rank0_resyncs_a_restarted_server_to_the_engines_version(world, capsys):
    world(1)
    d = _driver()
    RolloutDriver.resync(d, [server("http://n1:10008")])
    assert len(d.sync.calls) == 1
    buckets, version, workers = d.sync.calls[0]
    assert buckets == ["buckets of", ["model"]] and version == 7 and [w.url for w in workers] == ["http://n1:10008"]
    assert "resynced http://n1:10008 to weight version 7 (3 tensors" in capsys.readouterr().out
    world(4)  # data parallel only (TP = PP = 1): rank 0 holds the whole model
    RolloutDriver.resync(d, [server("http://n1:10008")])
    assert len(d.sync.calls) == 2


def test_with_adapter_only_sync_a_restarted_server_gets_the_current_adapter_not_the_model(world, monkeypatch):
    """LoRA (rollout.lora_sync): the server restarts from the base on disk; only the adapters are resent."""
    import megatron_dapo.bridge.peft as peft

    monkeypatch.setattr(peft, "adapter_hf_tensors", lambda model, arch: {"b.lora_B.weight": 2, "a.lora_A.weight": 1})
    world(1)
    d = _driver(adapters_only=True)
    RolloutDriver.resync(d, [server("http://n1:10008")])
    buckets, version, workers = d.sync.calls[0]
    assert buckets == [[("a.lora_A.weight", 1), ("b.lora_B.weight", 2)]] and version == 7


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_model_parallel_ranks_cannot_resync_mid_rollout(world, tp, pp):
    world(tp * pp)
    d = _driver(tp, pp)
    with pytest.raises(
        RolloutError, match=rf"parallel.tp x parallel.pp = {tp * pp}\), which wait for rank 0: stopping"
    ):
        RolloutDriver.resync(d, [server("http://n1:10008")])
    assert d.sync.calls == []
    world(1)  # one process holds every shard: allowed
    RolloutDriver.resync(d, [server("http://n1:10008")])
    assert len(d.sync.calls) == 1


def test_per_node_sync_refuses_another_nodes_engine(world):
    world(1)
    d = _driver(node_url="http://n1:10008")
    with pytest.raises(
        RolloutError, match=r"'http://n2:10008'\] restarted, but weights reach an engine only from its own"
    ):
        RolloutDriver.resync(d, [server("http://n1:10008"), server("http://n2:10008")])
    assert d.sync.calls == []
    RolloutDriver.resync(d, [server("http://n1:10008")])  # rank 0's own engine
    assert len(d.sync.calls) == 1


def test_an_off_policy_schedule_stops_instead_of_resyncing_under_training(world):
    world(1)
    d = _driver(1, 1, None, "rollout.schedule=one_step_off", "rollout.colocate=false")
    with pytest.raises(RolloutError, match="rollout.schedule = 'one_step_off' the trainer is training meanwhile"):
        RolloutDriver.resync(d, [server("http://n1:10008")])  # the actor's weights are newer than the batch's
    assert d.sync.calls == []
