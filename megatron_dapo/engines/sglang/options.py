"""SGLang's own config block, ``rollout.sglang:``, and the checks only SGLang needs. Config-level (it imports nothing
but the config's typing): ``config/run_config.py`` adds the block to ``RolloutConfig`` and ``config/validate.py``
runs ``validate`` through ``engines/registry.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


@dataclass
class SGLangOptions:
    tp: int = 1  # GPUs per server (--tp-size); one server per tp GPUs of a node (launch/placement.py)
    device: Literal["cuda", "cpu"] = "cuda"  # cpu: the real server on CPU cores (tests, demo_cpu_sglang)
    deterministic: bool = True  # --enable-deterministic-inference (honours sampling seeds; GPU backends only)
    args: list[str] = field(default_factory=list)  # more `sglang.launch_server` flags
    env: list[str] = field(default_factory=list)  # KEY=VALUE for the server processes
    pythonpath: list[str] = field(default_factory=list)  # prepended to the servers' PYTHONPATH


# the keys of this block before it was one (2026-12): a recipe or override using them is told where they went
MOVED_KEYS = {f"rollout.sglang_{k}": f"rollout.sglang.{k}" for k in ("tp", "device", "deterministic", "args", "env",
                                                                         "pythonpath")}  # fmt: skip

# every weight-update endpoint of SGLang 0.5.23 asserts get_parallel().dp_size == 1 (sglang/srt/managers/
# tokenizer_control_mixin.py: init_weights_update_group, update_weights_from_distributed/_tensor/_ipc, ...)
DP_FLAGS = ("--dp-size", "--dp", "--data-parallel-size")


def sglang_data_parallel(args: list[str] | tuple[str, ...]) -> str | None:
    """The flag in ``args`` that makes an SGLang server data-parallel (``--dp-size 2``, ``--dp=2``, or an abbreviation
    SGLang's argparse accepts, ``--dp-s 2``), as written; None if there is none. One check for the servers the trainer
    starts (``server.SGLangServer``) and those ``dapo launch`` starts (config validation, before any step)."""
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        full = len(flag) >= 4 and any(f.startswith(flag) for f in DP_FLAGS)  # argparse takes unique prefixes
        if not full:
            continue
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "1")
        try:
            if int(value) > 1:
                return f"{flag} {value}"
        except ValueError:
            continue  # not a size: SGLang's own parser refuses it
    return None


def validate(cfg: Any, fail: Callable[[str, Any, str], None]) -> None:
    """SGLang's rules, on a run whose ``rollout.engine`` is sglang; ``fail(key, value, why)`` raises."""
    r, s = cfg.rollout, cfg.rollout.sglang
    if s.tp < 1:
        fail("rollout.sglang.tp", s.tp, "must be >= 1")
    # client.py from_config: without server_urls the trainer starts one server itself, with SGLang's default
    # --base-gpu-id 0, i.e. on the trainer's own GPUs; uncolocated it never releases their memory. A CPU server runs
    # on cores (nothing shared to release), and under the disaggregated placement `dapo launch` starts the servers on
    # cluster.rollout_nodes and hands their URLs to the trainer. A server told which GPUs to use (--base-gpu-id,
    # CUDA_VISIBLE_DEVICES) is the user's choice.
    own_gpus = "--base-gpu-id" in s.args or any(kv.startswith("CUDA_VISIBLE_DEVICES=") for kv in s.env)
    colocated_layout = cfg.cluster.placement == "colocated"
    if s.device == "cuda" and not r.colocate and not r.server_urls and colocated_layout and not own_gpus:
        fail(
            "rollout.colocate",
            r.colocate,
            "with rollout.server_urls empty the trainer would start its SGLang server on its own GPUs (GPU 0 on, "
            "never releasing their memory): set rollout.server_urls=[URL, ...] (servers started on other GPUs or "
            "nodes), or cluster.placement=disaggregated with cluster.rollout_nodes and run `dapo launch` (it "
            "starts the servers on their own nodes), or rollout.sglang.args=[--base-gpu-id, N] (GPUs the trainer does "
            "not use), or rollout.colocate=true with rollout.schedule=sync",
        )
    dp_flag = sglang_data_parallel(s.args)
    if dp_flag:
        fail(
            "rollout.sglang.args",
            s.args,
            f"{dp_flag}: every weight update of SGLang asserts dp_size == 1 (tokenizer_control_mixin.py); for more "
            "replicas use more servers: dapo launch starts one per rollout.sglang.tp GPUs, or list them in "
            "rollout.server_urls",
        )
    # NCCL src/init.cc (initTransportsRank): "Duplicate GPU detected : rank %d and rank %d both on CUDA device" ->
    # ncclInvalidUsage, when two ranks of one communicator share a bus id; a gloo group (CPU servers) has no such rule
    if r.colocate and s.device == "cuda" and r.weight_sync == "distributed":
        fail(
            "rollout.weight_sync",
            r.weight_sync,
            "with rollout.colocate = true the sync group would hold trainer rank 0 and SGLang's TP rank 0 on one "
            "GPU, and NCCL refuses two ranks of a group on one device: use rollout.weight_sync=tensor (CUDA IPC, "
            "for colocated servers) or disk, or rollout.colocate=false with cluster.placement=disaggregated",
        )
    for kv in s.env:
        if "=" not in kv or not kv.split("=", 1)[0]:
            fail("rollout.sglang.env", kv, "entries are KEY=VALUE")
    if s.device == "cpu" and s.deterministic:
        fail(
            "rollout.sglang.deterministic",
            s.deterministic,
            "SGLang's deterministic inference needs a GPU attention backend (on a CPU it only has torch_native)",
        )
    if not r.server_urls:
        for path in s.pythonpath:
            if not Path(path).is_dir():
                fail("rollout.sglang.pythonpath", path, f"not a directory (relative to {Path.cwd()})")
