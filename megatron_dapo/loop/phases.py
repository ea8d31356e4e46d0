"""The memory phases of a GPU that the trainer and the rollout engines share: one call each from the loop.

    phases = make_phases(cfg, engine, actor)   # colocated: the trainer's grads + optimizer to the host at once
    phases.to_train()      # engines release weights, KV cache and CUDA graphs; the trainer's grads + optimizer come back
    ...train...
    phases.to_rollout()    # the trainer's grads + optimizer states go to the host; the engines resume their WEIGHTS
    ...weight sync (resumed weights are stale until it), generate (the engine resumes KV cache + CUDA graphs first)...

The order per step is slime's and NeMo-RL's: generate → release → train → offload → resume
weights → sync → resume KV cache and CUDA graphs → generate, so the sync's buckets never sit on top of a full KV
cache (slime ``train.py``: ``onload(tags=[weights])``, ``update_weights()``, ``onload(tags=[kv_cache])``; NeMo-RL
``prepare_for_generation(tags=["weights"])`` before the refit, ``tags=["kv_cache"]`` after). The engine resumes what
is still released when it is next asked to generate (``SGLangEngine.generate_stream``), whoever asks.

The phases start in the rollout phase, in the same state as after every ``to_rollout``: the constructor offloads
the trainer's grad buffers and optimizer states (present after a resume, and the DDP grad buffers from the start)
and releases the engines' KV cache and CUDA graphs until the first generation, so the first sync and the first
rollout of a run, or of a resumed one, fit in what ``plan.py``'s rollout phase counts.

``release_memory_occupation`` asserts that the server is idle: the loop has aborted what dynamic sampling did not
keep before ``to_train``, and the engine waits for a /flush_cache to succeed first (``SGLangEngine.sleep``). The trainer's
side uses megatron-core's own RL hooks (``DistributedDataParallel.offload_grad_buffers`` / ``restore_grad_buffers``,
``MegatronOptimizer.offload_to_cpu`` / ``restore_from_cpu``); its weights stay on the GPU (what ``plan.py``'s rollout
phase counts). On a CPU there is no accelerator memory to hand over: the trainer's calls are no-ops there, the
engines' calls still go to the servers (SGLang on CPU accepts them and frees nothing).

Not run on a GPU yet: the CUDA side (megatron-core's hooks, SGLang's memory saver) is read from their sources, not
measured; checkpoints are written in the rollout phase, with the optimizer states on the host.

Rank 0 makes the engine calls; every rank moves its own train state; the ranks meet on the control plane
(``driver.control_barrier``, a gloo group) so no engine resumes before every trainer rank on its GPUs has offloaded,
and no rank reloads before the engines have released.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from megatron_dapo.engines.registry import engine_spec
from megatron_dapo.loop.control import control_barrier, is_driver

AFTER_SYNC = ["kv_cache", "cuda_graph"]  # resumed after the weight sync (SGLangEngine.generate_stream resumes them)


class NoPhases:
    """Engines on their own GPUs (or none): nothing to hand over."""

    phase = "rollout"
    colocated = False

    def to_train(self) -> None:
        pass

    def to_rollout(self) -> None:
        pass


def offload_train_state(actor: Any) -> None:
    """Grads and optimizer states to the host (megatron-core's RL hooks); a no-op without CUDA."""
    if not torch.cuda.is_available():
        return
    for m in actor.model:
        m.offload_grad_buffers()
    actor.optimizer.offload_to_cpu()
    gc.collect()
    torch.cuda.empty_cache()


def reload_train_state(actor: Any) -> None:
    if not torch.cuda.is_available():
        return
    actor.optimizer.restore_from_cpu()
    for m in actor.model:
        m.restore_grad_buffers()


class MemoryPhases:
    """Colocated: the GPU alternates between the rollout phase (engines hold their weights and KV cache, the trainer
    only its weights) and the train phase (engines released). Starts in the rollout phase: the constructor offloads
    the trainer's state and releases the engines' KV cache and CUDA graphs (resumed at the first generation).
    ``log`` records each transition with its seconds (``timings``)."""

    colocated = True

    def __init__(self, engine: Any, actor: Any, offload=offload_train_state, reload=reload_train_state):
        self.engine, self.actor = engine, actor  # engine: rank 0's (None elsewhere)
        self._offload, self._reload = offload, reload
        self.phase = "rollout"
        self.log: list[str] = []
        self.timings: dict[str, float] = {}
        self._offload(actor)  # grad buffers (and, resumed, Adam states) are on the GPU until now
        self.log.append("trainer offloaded")
        if is_driver() and engine is not None:
            engine.sleep(AFTER_SYNC)  # idle at start; the first sync runs on the weights alone, as every later one
            self.log.append("engines released kv_cache, cuda_graph")
        control_barrier()  # released before any rank's first sync reaches an engine (per-node sync: node_sync.py)

    def to_train(self) -> None:
        if self.phase == "train":
            return
        t0 = time.monotonic()
        if is_driver() and self.engine is not None:
            self.engine.sleep()  # every tag: weights, KV cache, CUDA graphs
            self.log.append("engines released")
        control_barrier()  # released before any rank allocates
        self._reload(self.actor)
        self.log.append("trainer reloaded")
        self.phase = "train"
        self.timings["time/phase_to_train_s"] = time.monotonic() - t0

    def to_rollout(self) -> None:
        if self.phase == "rollout":
            return
        t0 = time.monotonic()
        self._offload(self.actor)
        self.log.append("trainer offloaded")
        control_barrier()  # every rank on the engines' GPUs has offloaded
        if is_driver() and self.engine is not None:
            self.engine.wake(["weights"])  # stale until the sync; KV cache + graphs at the next generation
            self.log.append("engines resumed weights")
        control_barrier()  # resumed before any rank sends an engine weights (per-node sync: node_sync.py)
        self.phase = "rollout"
        self.timings["time/phase_to_rollout_s"] = time.monotonic() - t0


def make_phases(cfg: Any, engine: Any, actor: Any) -> NoPhases | MemoryPhases:
    """MemoryPhases when the engine's servers share the trainer's GPUs (``rollout.colocate``), else NoPhases."""
    if engine_spec(cfg.rollout.engine).servers and cfg.rollout.colocate:
        return MemoryPhases(engine, actor)
    return NoPhases()
