"""Start-up preflight of a GPU job (``dapo train`` and ``dapo launch``, before any server or model is built): the
environment can run what the config asks for. One line per failed check, each naming the fix; a CPU run (the demo,
CI) passes silently.

    needs = needs_for(cfg, gpus_per_node=8, starts_servers=True)
    problems = check(needs, probe(needs))          # pure: facts in, lines out
    preflight(cfg, ...)                            # probe + check; PreflightError (a ConfigError) listing them

``python -m megatron_dapo.launch.preflight [NEEDS]`` prints this interpreter's facts as JSON: how ``dapo launch`` probes the
interpreter its steps run (``--python``) when that is not its own.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from megatron_dapo.config.run_config import DapoConfig
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.engines.registry import ENGINES, engine_spec
from megatron_dapo.versions import MCORE_RANGE, in_range

FIX_ENV = (
    "run with an environment that has the GPU stack: PYTHON=/path/to/gpu-venv/bin/python (slurm/*.sbatch), "
    "dapo launch --python ..., or cluster.container_image=<an image built from docker/Dockerfile>"
)


class PreflightError(ConfigError):
    """The environment cannot run the job; the message has one line per failed check."""


@dataclass(frozen=True)
class Needs:
    """What the job asks of this environment (``needs_for``)."""

    cuda: list[str] = field(default_factory=list)  # why the job runs on CUDA devices (empty: it need not)
    gpus_per_node: int = 0  # CUDA devices this node must show (0: not checked)
    gpus_why: str = ""
    te: list[str] = field(default_factory=list)  # why the model spec needs Transformer Engine (checked on GPU)
    # (module, what): the rollout engine's GPU packages, which its servers (or the trainer's transport) import here
    engine_modules: tuple[tuple[str, str], ...] = ()
    engine: str = ""  # rollout.engine, for the messages


@dataclass(frozen=True)
class Facts:
    """What this environment has (``probe``); import results: None = imported, else the error (not probed: "")."""

    torch: str = ""
    torch_cuda: str | None = None  # torch.version.cuda; None: a CPU build
    cuda_devices: int = 0
    mcore: str | None = None  # megatron-core's version; None: not installed
    imports: dict[str, str | None] = field(default_factory=dict)


def needs_for(cfg: DapoConfig, gpus_per_node: int = 0, starts_servers: bool = True, gpus_why: str = "") -> Needs:
    """The job's needs: ``gpus_per_node`` CUDA devices per node (the layout's, ``gpus_why``), ``starts_servers``:
    SGLang servers run from this environment (else only the trainer imports SGLang's serializer)."""
    r, m, p = cfg.rollout, cfg.model, cfg.parallel
    cuda = []
    spec = engine_spec(r.engine)
    if spec.on_gpus(cfg):
        cuda.append(f"rollout.engine = {r.engine!r} on CUDA")
    if m.fp8:
        cuda.append(f"model.fp8 = {m.fp8!r}")
    if m.transformer_impl == "transformer_engine":
        cuda.append("model.transformer_impl = 'transformer_engine'")
    te = [why for why in cuda if not why.startswith("rollout.")]
    if p.cp > 1:
        te.append(f"parallel.cp = {p.cp} (TE's context-parallel attention)")
    if p.sequence_parallel:
        te.append("parallel.sequence_parallel = true")
    # the trainer imports the engine's serializer (tensor) or its process group (distributed); servers all of it
    imports = spec.on_gpus(cfg) and (starts_servers or r.weight_sync != "disk")
    modules = spec.gpu_modules if imports else ()
    return Needs(
        cuda=cuda, gpus_per_node=gpus_per_node, gpus_why=gpus_why, te=te, engine_modules=modules, engine=r.engine
    )


def check(needs: Needs, facts: Facts) -> list[str]:
    """One line per failed check, naming the fix; empty when the environment can run the job."""
    out = []
    if facts.mcore is None:
        out.append(f"megatron-core is not installed: pip install 'megatron-core{MCORE_RANGE}'")
    elif not in_range(facts.mcore, MCORE_RANGE):
        out.append(
            f"megatron-core {facts.mcore} is outside the supported range {MCORE_RANGE} (megatron_dapo/"
            f"versions.py MCORE_RANGE): pip install 'megatron-core{MCORE_RANGE}'"
        )
    gpu = bool(needs.cuda) or facts.cuda_devices > 0
    if needs.cuda and facts.torch_cuda is None:
        out.append(
            f"torch {facts.torch} is a CPU build, but the job runs on CUDA devices ({'; '.join(needs.cuda)}): {FIX_ENV}"
        )
    elif gpu and needs.gpus_per_node and facts.cuda_devices < needs.gpus_per_node:
        out.append(
            f"this node shows {facts.cuda_devices} CUDA devices, the layout needs {needs.gpus_per_node} per node"
            f" ({needs.gpus_why or 'cluster.gpus_per_node'}): ask Slurm for them (--gpus-per-node), check "
            "CUDA_VISIBLE_DEVICES, or plan for the GPUs the nodes have"
        )
    if gpu and needs.te and facts.imports.get("transformer_engine.pytorch"):
        out.append(
            f"Transformer Engine is not importable ({facts.imports['transformer_engine.pytorch']}), but "
            f"{'; '.join(needs.te)} needs it: install transformer-engine[pytorch] (requirements/gpu.txt; the "
            "image of docker/Dockerfile has it), or turn those settings off"
        )
    for module, what in needs.engine_modules:
        if facts.imports.get(module):
            out.append(
                f"{what} not importable ({facts.imports[module]}), but rollout.engine = {needs.engine!r} runs on CUDA: "
                f"install the pins of requirements/gpu.txt, or {FIX_ENV}"
            )
    return out


def _try_import(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as e:  # a half-installed TE or an sgl_kernel built for another torch raises OSError, RuntimeError
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return None


def probe(needs: Needs | None = None) -> Facts:
    """This interpreter's facts; imports only what ``needs`` asks (all of them without ``needs``)."""
    import torch

    try:
        mcore = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        mcore = None
    devices = torch.cuda.device_count() if torch.version.cuda else 0
    if devices and os.environ.get("LOCAL_RANK"):  # imports that query the GPU make their context on this rank's own
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % devices)
    gpu = needs is None or bool(needs.cuda) or devices > 0
    modules = []
    if needs is None or (gpu and needs.te):
        modules.append("transformer_engine.pytorch")
    every = [m for spec in ENGINES.values() for m in spec.gpu_modules]
    modules += [module for module, _ in (every if needs is None else needs.engine_modules)]
    return Facts(torch.__version__, torch.version.cuda, devices, mcore, {m: _try_import(m) for m in modules})


def probe_python(python: str | list[str], needs: Needs, where: str = "") -> Facts:
    """The facts of another interpreter (``python -m megatron_dapo.launch.preflight``); its own when it is this one.
    ``python`` may be a command line ending in the interpreter: ``srun ... --container-image=IMG python`` probes the
    image's (``where`` names it in the errors)."""
    if isinstance(python, str) and os.path.realpath(python) == os.path.realpath(sys.executable):
        return probe(needs)
    prefix = [python] if isinstance(python, str) else list(python)
    shown = where or prefix[-1]
    try:
        cmd = [*prefix, "-m", "megatron_dapo.launch.preflight", json.dumps(asdict(needs))]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)  # an image may take minutes to unpack
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PreflightError(f"preflight: cannot run {shown}: {e}") from e
    if out.returncode != 0 or not out.stdout.strip():
        raise PreflightError(
            f"preflight: {shown} -m megatron_dapo.launch.preflight failed ({out.returncode}): "
            f"{out.stderr.strip()[-500:]}; {FIX_ENV}"
        )
    return Facts(**json.loads(out.stdout.splitlines()[-1]))


def preflight(
    cfg: DapoConfig,
    gpus_per_node: int = 0,
    starts_servers: bool = True,
    python: str | list[str] | None = None,
    where: str = "dapo train",
    gpus_why: str = "",
    engine_imports: bool = True,
    python_name: str = "",
) -> None:
    """Probe and check (the engine's imports unless ``engine_imports`` is false); raise ``PreflightError`` with every failed
    check, one per line. ``python``: another interpreter, or a command line ending in one (``probe_python``)."""
    needs = needs_for(cfg, gpus_per_node, starts_servers, gpus_why)
    if not engine_imports:
        needs = dataclasses.replace(needs, engine_modules=())
    problems = check(needs, probe_python(python, needs, python_name) if python else probe(needs))
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise PreflightError(f"{where}: preflight: this environment cannot run the job:\n{lines}")


def train_preflight(cfg: DapoConfig, env: dict | None = None) -> None:
    """``dapo train``, every rank, before the model or a server: this rank's environment, and (rank 0, outside
    ``dapo launch``'s per-node sync) that a ``tensor`` sync reaches its servers (``driver.check_tensor_sync_reach``)."""
    env = os.environ if env is None else env
    r = cfg.rollout
    local = int(env.get("LOCAL_WORLD_SIZE") or 1)
    spec = engine_spec(r.engine)
    starts = spec.servers and not r.server_urls
    gpus = max(local, spec.tp(cfg) if starts and r.colocate else 0)
    why = f"{local} trainer ranks on this node" + (f", {spec.tp_key} = {spec.tp(cfg)}" if gpus > local else "")
    # the engine's packages: imported once per node (the node's ranks share the environment)
    preflight(cfg, gpus, starts, gpus_why=why, engine_imports=env.get("LOCAL_RANK", "0") == "0")
    if env.get("RANK", "0") == "0" and not env.get("DAPO_LOCAL_SERVER_URL"):
        from megatron_dapo.loop.rollout import check_tensor_sync_reach

        check_tensor_sync_reach(cfg)


def launch_preflight(
    cfg: DapoConfig,
    gpus_per_node: int,
    servers: int,
    python: str,
    stand_ins: bool = False,
    in_image: list[str] | None = None,
) -> None:
    """``dapo launch``, before any job step: the interpreter the steps run (``python``; this node's GPUs stand for
    every node's). In a container (``cluster.container_image``) that is the image's: ``in_image``, the command line of
    a one-task step in the image on the first node, ending in its interpreter (``LaunchPlan.preflight``), probes it
    there, before any server step. Nothing to check for a CPU job (each rank's ``dapo train`` checks its own) or for
    stand-in programs (``--server-cmd``/``--trainer-cmd``)."""
    if not gpus_per_node or stand_ins:
        return
    why = "the plan's GPUs per node: SLURM_GPUS_ON_NODE, --gpus-per-node or cluster.gpus_per_node"
    if cfg.cluster.container_image:
        if not in_image:
            return
        where = f"dapo launch (in cluster.container_image = {cfg.cluster.container_image})"
        name = f"cluster.container_image = {cfg.cluster.container_image}'s python (srun on {in_image_node(in_image)})"
        preflight(cfg, gpus_per_node, servers > 0, python=in_image, where=where, gpus_why=why, python_name=name)
        return
    preflight(cfg, gpus_per_node, servers > 0, python=python, where="dapo launch", gpus_why=why)


def in_image_node(cmd: list[str]) -> str:
    """The node an ``srun --nodelist=NODE ...`` command line runs on."""
    return next((a.split("=", 1)[1] for a in cmd if a.startswith("--nodelist=")), "?")


if __name__ == "__main__":  # [NEEDS as JSON]: what to probe (default: everything)
    given = json.loads(sys.argv[1]) if len(sys.argv) > 1 else None
    if given is not None:
        given["engine_modules"] = tuple(tuple(m) for m in given.get("engine_modules", ()))  # JSON lists back
    print(json.dumps(asdict(probe(Needs(**given) if given is not None else None))))
