"""Memory phases as one call each (issue 14): the order of the engine and trainer calls, no-ops when not colocated."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_dapo.config import load_config
from megatron_dapo.rollout.phases import MemoryPhases, NoPhases, make_phases


class Recorder:
    def __init__(self):
        self.calls: list[str] = []

    def sleep(self, tags=None):
        self.calls.append("engine.release")

    def wake(self, tags=None):
        self.calls.append("engine.resume")


def test_memory_phases_order_and_idempotence():
    engine = Recorder()
    calls = engine.calls
    phases = MemoryPhases(engine, actor="actor", offload=lambda a: calls.append(f"{a}.offload"),
                          reload=lambda a: calls.append(f"{a}.reload"))  # fmt: skip
    assert phases.phase == "rollout" and phases.colocated  # servers start holding their memory
    phases.to_rollout()  # already there: nothing
    assert calls == []
    phases.to_train()
    phases.to_train()
    assert calls == ["engine.release", "actor.reload"] and phases.phase == "train"
    phases.to_rollout()
    assert calls[2:] == ["actor.offload", "engine.resume"] and phases.phase == "rollout"
    assert set(phases.timings) == {"time/phase_to_train_s", "time/phase_to_rollout_s"}
    assert phases.log == ["engines released", "trainer reloaded", "trainer offloaded", "engines resumed"]


def test_ranks_without_the_engine_only_move_their_own_state():
    calls = []
    phases = MemoryPhases(
        None, actor="a", offload=lambda a: calls.append("offload"), reload=lambda a: calls.append("reload")
    )
    phases.to_train()
    phases.to_rollout()
    assert calls == ["reload", "offload"]


def test_trainer_state_hooks_are_noops_without_cuda():
    from megatron_dapo.rollout.phases import offload_train_state, reload_train_state

    actor = SimpleNamespace()  # no model, no optimizer: touched only with CUDA
    offload_train_state(actor)
    reload_train_state(actor)


def test_make_phases_picks_by_placement():
    engine = Recorder()
    assert isinstance(make_phases(load_config("demo_cpu"), engine, None), NoPhases)  # HF engine, in-process
    cfg = load_config("demo_cpu_sglang", ["rollout.colocate=true"])  # the CPU server takes the calls, frees nothing
    assert isinstance(make_phases(cfg, engine, None), MemoryPhases)
    cfg = load_config("demo_cpu_sglang")  # colocate: false
    no = make_phases(cfg, engine, None)
    no.to_train()
    no.to_rollout()
    assert isinstance(no, NoPhases) and engine.calls == []
