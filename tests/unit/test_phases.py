"""Memory phases as one call each (issue 14): the order of the engine and trainer calls, no-ops when not colocated.
Issue 22: the phases start offloaded (#8), and the engines resume only their weights before the sync (#9)."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_dapo.config.run_config import load_config
from megatron_dapo.loop.phases import MemoryPhases, NoPhases, make_phases


class Recorder:
    def __init__(self):
        self.calls: list[str] = []

    def sleep(self, tags=None):
        self.calls.append("engine.release" + (f" {','.join(tags)}" if tags else ""))

    def wake(self, tags=None):
        self.calls.append("engine.resume" + (f" {','.join(tags)}" if tags else ""))


def phases_with(engine, calls):
    return MemoryPhases(engine, actor="actor", offload=lambda a: calls.append(f"{a}.offload"),
                        reload=lambda a: calls.append(f"{a}.reload"))  # fmt: skip


def test_memory_phases_order_and_idempotence():
    engine = Recorder()
    calls = engine.calls
    phases = phases_with(engine, calls)
    assert phases.phase == "rollout" and phases.colocated
    # issue 22 #8: the first rollout phase is offloaded as every later one (grad buffers exist from the start,
    # Adam states after a resume); the engines keep only their weights until the first generation (#9)
    assert calls == ["actor.offload", "engine.release kv_cache,cuda_graph"]
    phases.to_rollout()  # already there: nothing
    assert calls[2:] == []
    phases.to_train()
    phases.to_train()
    assert calls[2:] == ["engine.release", "actor.reload"] and phases.phase == "train"
    phases.to_rollout()
    # issue 22 #9: the weights alone before the sync; KV cache + CUDA graphs when the engine next generates
    assert calls[4:] == ["actor.offload", "engine.resume weights"] and phases.phase == "rollout"
    assert set(phases.timings) == {"time/phase_to_train_s", "time/phase_to_rollout_s"}
    assert phases.log == ["trainer offloaded", "engines released kv_cache, cuda_graph", "engines released",
                          "trainer reloaded", "trainer offloaded", "engines resumed weights"]  # fmt: skip


def test_ranks_without_the_engine_only_move_their_own_state():
    calls = []
    phases = MemoryPhases(
        None, actor="a", offload=lambda a: calls.append("offload"), reload=lambda a: calls.append("reload")
    )
    assert calls == ["offload"]  # every rank offloads its own state at the start (issue 22 #8)
    phases.to_train()
    phases.to_rollout()
    assert calls == ["offload", "reload", "offload"]


class Hooked:
    """megatron-core's RL hooks (DistributedDataParallel / MegatronOptimizer), recorded."""

    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def __getattr__(self, hook):
        return lambda *a, **k: self.calls.append(f"{self.name}.{hook}")


def test_trainer_state_hooks_call_megatron_core_only_with_cuda(monkeypatch):
    import torch

    from megatron_dapo.loop import phases as ph

    calls = []
    actor = SimpleNamespace(model=[Hooked(calls, "chunk0"), Hooked(calls, "chunk1")], optimizer=Hooked(calls, "opt"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ph.offload_train_state(actor)
    ph.reload_train_state(actor)
    assert calls == []  # no accelerator memory to hand over on a CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    ph.offload_train_state(actor)
    assert calls == ["chunk0.offload_grad_buffers", "chunk1.offload_grad_buffers", "opt.offload_to_cpu", "empty_cache"]
    calls.clear()
    ph.reload_train_state(actor)
    assert calls == ["opt.restore_from_cpu", "chunk0.restore_grad_buffers", "chunk1.restore_grad_buffers"]


def test_make_phases_picks_by_placement(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the actor is None here: no state to move
    engine = Recorder()
    assert isinstance(make_phases(load_config("demo_cpu"), engine, None), NoPhases)  # HF engine, in-process
    cfg = load_config("demo_cpu_sglang", ["rollout.colocate=true"])  # the CPU server takes the calls, frees nothing
    assert isinstance(make_phases(cfg, engine, None), MemoryPhases)
    engine.calls.clear()
    cfg = load_config("demo_cpu_sglang")  # colocate: false
    no = make_phases(cfg, engine, None)
    no.to_train()
    no.to_rollout()
    assert isinstance(no, NoPhases) and engine.calls == []
