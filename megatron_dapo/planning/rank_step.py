"""One rank of the GPU job trains once on a CPU: the real actor on fake tensors and a fake process group, its memory
measured by torch's own accounting of what is alive.

    with rehearsal_world(rank, world, cfg):      # this process is `rank` of `world` (torch's fake process group)
        m = run_rank_step(cfg)                  # RankStep: bytes alive after each phase, and each phase's peak

What runs is the product's code, unchanged: ``MegatronActor`` builds the model (``actor/provider.py``), wraps it in
megatron-core's ``DistributedDataParallel`` and builds megatron-core's (distributed) optimizer; one DAPO update goes
through megatron-core's pipeline schedule with the recipe's longest packed sequence in each micro-batch
(``parallel.max_tokens_per_micro_batch`` tokens, ``pp`` micro-batches per DP rank: 1F1B's most in flight); the
optimizer steps; the logprob pass runs forward only; the bridge exports the model the way the weight sync does.

Parameters, gradients, optimizer states and activations are ``FakeTensor``s (``torch._subclasses.fake_tensor``):
shapes, dtypes and lifetimes, no data, no memory. The micro-batches' token ids and masks are real (a few MB).
``torch.distributed._tools.mem_tracker.MemTracker`` counts the bytes of every storage alive (the same accounting
FSDP2's memory estimator uses). Where TE modules would run, ``planning/te_standins.py`` says what stands in.

The few places where the fake world needs help are in ``rehearsal_world`` and nowhere else, each with its reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from megatron_dapo.config.run_config import DapoConfig
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.models.arch import load_arch
from megatron_dapo.planning.fake_ranks import fake_rank


@dataclass
class RankStep:
    """Bytes on one GPU of one rank, measured: what is alive after each phase, and the peak inside it."""

    rank: int
    params: int = 0  # parameters the step's model holds
    expert_params: int = 0  # of which the MoE experts' (``.mlp.experts.``)
    after: dict[str, int] = field(default_factory=dict)  # phase -> bytes alive when it ended
    peak: dict[str, int] = field(default_factory=dict)  # phase -> the most bytes alive during it
    parts: dict[str, int] = field(default_factory=dict)  # resident state by kind, from the live objects
    micro_batches: int = 0
    micro_batch_tokens: int = 0
    exported_tensors: int = 0
    unmapped: list[str] = field(default_factory=list)  # built parameters the bridge's table does not name
    unbuilt: list[str] = field(default_factory=list)  # the table's parameters of this stage megatron-core did not build
    seconds: float = 0.0

    def transient(self, phase: str) -> int:
        """What ``phase`` adds at its peak to the resident state (weights, grads, optimizer after the warm-up)."""
        return self.peak[phase] - self.after["warmup"]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RankStep:
        return cls(**data)


# ----------------------------------------------------------------------------------------------------------------------
# The fake world


def _one_value(self, *args, **kwargs):
    return 1.0 if self.dtype.is_floating_point else 1


def _one_float(self):
    return 1.0


def _one_int(self):
    return 1


def _ones_list(self):
    one = 1.0 if self.dtype.is_floating_point else 1
    shape = list(self.shape)

    def nest(dims):
        return [one] * dims[0] if len(dims) == 1 else [nest(dims[1:]) for _ in range(dims[0])]

    return nest(shape) if shape else one


class _NoModules:
    """In place of ``MemTracker``'s ``ModTracker`` (torch 2.13 distributed/_tools/mod_tracker.py), which hooks every
    module's forward and registers gradient hooks on its inputs and outputs: among them, the tensor hooks a model
    output already has stop being called (the actor's ``routes.replay_in_backward`` on a pipeline stage's output:
    the recomputed MoE layers would route on their own instead of replaying). The totals need none of it: only
    ``is_bw`` is read, to label a storage as forward or backward."""

    is_bw = False
    parents: set = set()

    def register_user_hooks(self, *args, **kwargs):
        pass

    def clear_user_hooks(self):
        pass

    def get_known_fqn(self, module):
        return type(module).__name__

    def __enter__(self):
        return self

    def __exit__(self, *args):
        pass


class _Tracker:
    """``MemTracker``'s storage accounting (every storage alive, by device) with a per-phase peak. Its per-module
    statistics are off (``_NoModules``): it refuses a module entered twice without a reset (torch 2.13
    distributed/_tools/mem_tracker.py:673), and every micro-batch enters each layer again; the totals do not depend
    on them."""

    def __init__(self):
        from torch.distributed._tools.mem_tracker import MemTracker

        class _TotalsOnly(MemTracker):
            def __init__(self):
                super().__init__()
                self._mod_tracker = _NoModules()

        self.mt = _TotalsOnly()

    def total(self, kind: str = "current") -> int:
        snap = self.mt.get_tracker_snapshot(kind)
        return int(sum(dev.get("Total", 0) for dev in snap.values()))

    @contextlib.contextmanager
    def phase(self, name: str, result: RankStep) -> Iterator[None]:
        self.mt._peak_mem = {}  # a phase's own peak: MemTracker keeps one per device since it was entered
        self.mt._peak_mem_snap = {}
        yield
        result.after[name] = self.total("current")
        result.peak[name] = max(self.total("peak"), result.after[name])


def _refuse(me, want):
    raise RuntimeError(f"rehearsal: this rank's expert coordinates {me} are not the ones computed for it, {want}")


@contextlib.contextmanager
def rehearsal_world(rank: int, world: int, cfg: DapoConfig) -> Iterator[None]:
    """This process is ``rank`` of ``world`` for the real actor: torch's fake process group, megatron-core's groups,
    and these helps, undone at the end:
    - gloo groups (megatron-core's DP groups for the distributed optimizer, the actor's control group) are fake-backend
      groups: a real gloo group would wait for 127 peers that do not exist;
    - ``all_gather_object`` gives every rank this rank's object and ``broadcast_object_list`` keeps it: the fake group
      moves no data, and the ranks of one class hold the same keys (megatron-core's param-group check, the actor's
      DP membership);
    - a fake tensor read as a number (``item``, ``float``, ``int``, ``tolist``: a gradient norm, a loss to log) reads
      1: it has no value;
    - pipeline stages exchange activations of the schedule's ``tensor_shape`` without first exchanging their shapes
      (``variable_seq_lengths``; megatron-core pipeline_parallel/p2p_communication.py ``_communicate``): the fake
      group delivers no shapes, and every micro-batch here holds the same number of tokens;
    - DDP's bucket collectives run one by one, not coalesced: torch has no fake kernel for the coalesced
      reduce-scatter and all-gather (torch 2.13 distributed/_tools/fake_collectives.py lists them as missing);
      megatron-core distributed/param_and_grad_buffer.py wraps them in ``_coalescing_manager``;
    - stage 0 of the export takes the manifest a later stage sends (how many tensors, their dtypes) as the one it
      expects (``bridge/export.py`` ``recv_manifest``); each stage's own side is checked against the mapping table
      where that stage is rehearsed;
    - a mixture of experts: the routing probe's agreement (``actor/routes.py`` ``agreement``: how often the model's
      own top-k, a fake tensor, equals the engine's routes) reads as full agreement; the probe's two forward passes run;
    - a mixture of experts: the export's all-gather of every rank's expert coordinates (``bridge/export.py``
      ``all_expert_coordinates``: who owns which expert, who receives a stage's) gives each rank's own, which
      megatron-core's ``parallel_state`` gave that rank (``fake_rank`` as each rank in turn, before this one's world);
    - MemTracker counts what runs under the fake mode: it skips ops under a fake mode other than the one active when
      it was entered (torch 2.13 distributed/_tools/mem_tracker.py:947, for DTensor's sharding propagation, which
      the actor does not use), and here the model is built under one;
    - the tensor-parallel collectives' outputs (megatron-core tensor_parallel/mappings.py:91, :141, :148, :181:
      ``torch.empty`` on the current device) are made under their fake input's mode: fake, like the input, where
      they would be real host tensors of the same size (the same bytes counted, but real memory and real copies on
      this machine: a recomputed MoE layer's all-gathered routed copies, 0.7 GiB each at the 30B recipe's length);
    - ``torch.compile`` is off (megatron-core's fused SwiGLU is compiled on GPU; fake tensors run it eagerly);
    - the TE stand-ins (``planning/te_standins.py``) in place of the TE spec;
    - a mixture of experts: the alltoall dispatcher's token counts and ``permute``'s ``masked_select`` are data (how
      many tokens each expert gets): a balanced dropless routing's counts stand in, the busiest expert-parallel rank
      receiving ``PlanOptions.moe_imbalance`` × its share (``planning/moe_standins.py``, with megatron-core's lines).
    """
    import torch._dynamo
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensor

    from megatron_dapo.actor.provider import te_stand_in
    from megatron_dapo.planning.moe_standins import moe_stand_ins
    from megatron_dapo.planning.te_standins import block_spec

    p = cfg.parallel
    if p.cp > 1:
        raise ConfigError(
            f"parallel.cp = {p.cp}: the rehearsal's step cannot run context parallelism (TE's ring attention); "
            "rehearse with parallel.cp=1 and the same token budget per GPU"
        )
    saved = {
        (dist, "new_group"): dist.new_group,
        (dist, "all_gather_object"): dist.all_gather_object,
        (dist, "broadcast_object_list"): dist.broadcast_object_list,
        **{(FakeTensor, n): FakeTensor.__dict__.get(n) for n in ("item", "__float__", "__int__", "tolist")},
    }
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from torch.distributed._tools import mem_tracker

    saved[(mem_tracker, "active_fake_mode")] = mem_tracker.active_fake_mode
    mem_tracker.active_fake_mode = lambda: None

    saved[(P2PCommunicator, "_communicate")] = P2PCommunicator._communicate
    real_new_group, real_communicate = dist.new_group, P2PCommunicator._communicate

    def communicate(self, **kwargs):
        variable, self.config.variable_seq_lengths = self.config.variable_seq_lengths, False
        try:
            return real_communicate(self, **kwargs)
        finally:
            self.config.variable_seq_lengths = variable

    P2PCommunicator._communicate = communicate
    from megatron.core.distributed import param_and_grad_buffer

    saved[(param_and_grad_buffer, "_coalescing_manager")] = param_and_grad_buffer._coalescing_manager

    @contextlib.contextmanager
    def one_by_one(*_args, **_kwargs):
        yield None

    param_and_grad_buffer._coalescing_manager = one_by_one
    from megatron_dapo.actor.provider import DTYPES
    from megatron_dapo.bridge import export

    saved[(export, "recv_manifest")] = export.recv_manifest
    code = export._DTYPE_CODES.index(DTYPES[cfg.model.dtype])
    export.recv_manifest = lambda stage, expected, src, device: [code] * expected
    from megatron.core.tensor_parallel import mappings

    def on_its_mode(real):
        def run(input_, *args, **kwargs):
            if not isinstance(input_, FakeTensor):
                return real(input_, *args, **kwargs)
            with input_.fake_mode:
                return real(input_, *args, **kwargs)

        return run

    for name in ("_gather_along_first_dim", "_gather_along_last_dim", "_reduce_scatter_along_first_dim"):
        saved[(mappings, name)] = getattr(mappings, name)
        setattr(mappings, name, on_its_mode(getattr(mappings, name)))
    from megatron_dapo.actor import routes

    saved[(routes, "agreement")] = routes.agreement
    routes.agreement = lambda chosen, targets, routed: (len(chosen) * int(routed.sum()),) * 2
    if load_arch(cfg.model.arch).is_moe:  # every rank's coordinates, from megatron-core's parallel_state as that rank
        everyone, hook = [], sys.excepthook  # (each init_process_group wraps sys.excepthook with its rank)
        for r in range(world):
            with fake_rank(r, world, p.tp, p.pp, p.cp, p.ep):
                everyone.append(export.expert_coordinates())
        sys.excepthook = hook
        saved[(export, "all_expert_coordinates")] = export.all_expert_coordinates
        export.all_expert_coordinates = lambda me: everyone if me == everyone[rank] else _refuse(me, everyone[rank])

    def new_group(*args, **kwargs):
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = "fake"
        return real_new_group(*args, **kwargs)

    def all_gather_object(out, obj, group=None):
        out[:] = [obj] * len(out)

    dist.new_group, dist.all_gather_object = new_group, all_gather_object
    dist.broadcast_object_list = lambda *a, **k: None
    FakeTensor.item, FakeTensor.__float__, FakeTensor.__int__ = _one_value, _one_float, _one_int
    FakeTensor.tolist = _ones_list
    compile_off = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    try:
        with fake_rank(rank, world, p.tp, p.pp, p.cp, p.ep, gloo_groups=True), te_stand_in(block_spec), moe_stand_ins():
            yield
    finally:
        torch._dynamo.config.disable = compile_off
        for (owner, name), value in saved.items():
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


# ----------------------------------------------------------------------------------------------------------------------
# The step


def step_config(cfg: DapoConfig) -> DapoConfig:
    """The recipe as the step runs it on a CPU: FP8 off (its weight copies are counted from the GEMM weights), the
    recipe's everything else; π_old from a pass (the logprob pass runs). A mixture of experts keeps the recipe's
    routing replay: the sequences carry balanced routes in the engine's place (``_sequences``)."""
    model = dataclasses.replace(cfg.model, fp8=None, transformer_impl="local")
    return dataclasses.replace(cfg, model=model)


def balanced_routes(tokens: int, moe_layers: int, topk: int, experts: int, offset: int = 0) -> torch.Tensor:
    """[tokens - 1, MoE layers, top-k] routes (``types.Sequence.routes``, what the engine returns) that spread the
    tokens' copies evenly over the experts: token t's j-th expert is (t·k + j + offset) mod E in every layer."""
    t = torch.arange(tokens - 1, dtype=torch.long)[:, None] * topk + torch.arange(topk) + offset
    return (t % experts)[:, None, :].expand(tokens - 1, moe_layers, topk).contiguous()


def _sequences(cfg: DapoConfig, count: int, arch, length: int = 0):
    """``count`` sequences of the recipe's longest length (the longest prompt, the longest response; each fills a
    micro-batch) or of ``length`` tokens: real token ids, advantages, π_old and rollout logprobs, and for a mixture of
    experts the engine's routes (``balanced_routes``; the routers replay them where the recipe's routing replay is on,
    else only the routing probe compares them)."""
    from megatron_dapo.types import Sequence

    prompt = cfg.data.max_prompt_len if not length else length // 2
    length = length or min(
        prompt + cfg.rollout.sampling.max_new_tokens, cfg.parallel.max_tokens_per_micro_batch or 1 << 62
    )
    g = torch.Generator().manual_seed(0)
    moe_layers = sum(arch.moe_layer_pattern()) if arch.is_moe else 0
    out = []
    for i in range(count):
        tokens = torch.randint(0, arch.vocab_size, (length,), generator=g)
        r = length - prompt
        out.append(
            Sequence(
                tokens=tokens,
                prompt_len=prompt,
                advantage=1.0 if i % 2 else -1.0,
                old_logprobs=torch.full((r,), -1.0),
                rollout_logprobs=torch.full((r,), -1.0),
                loss_mask=torch.ones(r),
                routes=balanced_routes(length, moe_layers, arch.moe_topk, arch.num_experts, i) if moe_layers else None,
            )
        )
    return out


def _resident_parts(actor) -> dict[str, int]:
    """The resident state by kind, read from the live objects (their storages' sizes, not a formula)."""

    def storage_bytes(tensors) -> int:
        seen, n = set(), 0
        for t in tensors:
            st = t.untyped_storage()
            key = id(st) if isinstance(t, torch._subclasses.fake_tensor.FakeTensor) else st.data_ptr()
            if key not in seen:
                seen.add(key)
                n += st.nbytes()
        return n

    params = [p for m in actor.model for p in m.module.parameters()]
    grads = [
        b.grad_data for m in actor.model for b in getattr(m, "buffers", []) + getattr(m, "expert_parallel_buffers", [])
    ]
    states = []
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for st in opt.optimizer.state.values():
            states += [v for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
        for group in getattr(opt, "shard_fp32_from_float16_groups", []) or []:
            states += list(group)
    return {"weights": storage_bytes(params), "grads": storage_bytes(grads), "optimizer": storage_bytes(states)}


def _mapping_gaps(actor, arch) -> tuple[list[str], list[str]]:
    """The bridge's table against the parameters megatron-core built on this rank: built but unnamed, and named for
    this pipeline stage but not built (``bridge/export.py``: stage 0 would wait for a tensor no stage sends)."""
    from megatron.core import parallel_state as ps

    from megatron_dapo.bridge.export import _stage_of, export_order, local_parameters

    local = local_parameters(actor.model, arch)
    table = export_order(arch)
    stage, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    named = {p.megatron for p in table}
    mine = {p.megatron for p in table if _stage_of(p, arch, pp) == stage}
    if arch.is_moe:  # this EP rank builds its own experts only
        mine = {n for n in mine if n in local or ".mlp.experts." not in n}
    adapters = {n for n in local if n.endswith((".lora_A", ".lora_B"))}  # LoRA: merged or exported by bridge/peft.py
    return sorted(set(local) - named - adapters), sorted(mine - set(local))


def run_rank_step(cfg: DapoConfig, progress=None) -> RankStep:
    """Inside ``rehearsal_world``: build the actor, one update, the optimizer step, the logprob pass and the export,
    each a phase of the returned ``RankStep`` (``progress(phase)`` as each starts)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.step_metrics import StepTally
    from megatron_dapo.bridge.export import export_hf_tensors

    t0 = time.monotonic()
    cfg = step_config(cfg)
    arch = load_arch(cfg.model.arch)
    tell = progress or (lambda _phase: None)
    out = RankStep(rank=dist.get_rank())
    tracker = _Tracker()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    # the samples are the host's (the actor packs each micro-batch and moves it to the GPU, counted there): made before
    # the tracker counts, as an MoE's routes are big (Qwen3-30B-A3B: 69 MB a 22k-token sample, every layer's)
    dp = ps.get_data_parallel_world_size()
    warm, seqs = _sequences(cfg, dp, arch, 64), _sequences(cfg, dp * max(cfg.parallel.pp, 1), arch)
    with tracker.mt, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core: "Apex is not installed", per module
        tell("build")
        with tracker.phase("build", out), fake:  # every tensor the actor makes is fake; the data below is real
            actor = MegatronActor(cfg, arch)
        out.unmapped, out.unbuilt = _mapping_gaps(actor, arch)
        out.params = sum(p.numel() for m in actor.model for p in m.module.parameters())
        out.expert_params = sum(
            p.numel() for m in actor.model for n, p in m.module.named_parameters() if ".mlp.experts." in n
        )
        # Adam's moments exist from the first update on: a short update first, so the measured one is a steady step
        tell("warmup")
        with tracker.phase("warmup", out):
            actor.update_mini_batch(warm, StepTally(0.0), False)
        assert actor.dp_size == dp
        out.micro_batch_tokens = actor.micro_batch_tokens
        tell("train")
        tally = StepTally(time.perf_counter())
        with tracker.phase("train", out):
            actor.update_mini_batch(seqs, tally, from_forward=False)
        out.micro_batches = tally.micro_batches
        out.parts = _resident_parts(actor)
        tell("old_logprobs")
        with tracker.phase("old_logprobs", out):
            actor.logprob_pass(seqs, with_entropy=True)
        tell("export")
        with tracker.phase("export", out), fake:
            for bucket in export_hf_tensors(actor.model, arch, cfg.rollout.bucket_mb << 20):
                out.exported_tensors += len(bucket)
                del bucket
        del actor
    out.seconds = time.monotonic() - t0
    return out


# ----------------------------------------------------------------------------------------------------------------------
# One process per rank (a process is one fake rank at a time; megatron-core's state is global)


def run_steps(cfg: DapoConfig, ranks: list[int], world: int, jobs: int = 2, progress=None, timeout_s: float = 3600):
    """``run_rank_step`` for each of ``ranks`` in a process of its own, ``jobs`` at a time: {rank: RankStep}.
    ``progress(done, total)`` as each ends. A rank that fails raises, naming it, with the end of its log."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from megatron_dapo.config.run_config import save_config

    with tempfile.TemporaryDirectory(prefix="dapo-rehearse-") as tmp:
        path = os.path.join(tmp, "config.yaml")
        save_config(cfg, path)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)  # the step's world is the fake one

        def one(rank: int) -> RankStep:
            cmd = [sys.executable, "-m", "megatron_dapo.planning.rank_step", path, str(rank), str(world)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
            if done.returncode != 0:
                tail = "\n".join(done.stderr.strip().splitlines()[-15:])
                raise RuntimeError(f"rehearsal step of rank {rank} failed (exit {done.returncode}):\n{tail}")
            return RankStep.from_dict(json.loads(done.stdout.strip().splitlines()[-1]))

        out: dict[int, RankStep] = {}
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for rank, step in zip(ranks, pool.map(one, ranks)):
                out[rank] = step
                if progress is not None:
                    progress(len(out), len(ranks))
        return out


def main(argv: list[str] | None = None) -> int:
    """python -m megatron_dapo.planning.rank_step CONFIG.yaml RANK WORLD: one JSON line, the RankStep."""
    import json
    import sys

    from megatron_dapo.actor.cpu import apply_cpu_shims
    from megatron_dapo.config.run_config import load_config

    path, rank, world = (argv if argv is not None else sys.argv[1:])[:3]
    cfg = load_config(path, [])
    apply_cpu_shims()
    with rehearsal_world(int(rank), int(world), cfg):
        step = run_rank_step(cfg)
    print(json.dumps(step.as_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
