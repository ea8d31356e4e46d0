"""The vLLM engine's parts that need no server: its config block's rules, its Slurm job steps (dapo launch --dry-run
of the 32B recipe with rollout.engine=vllm), its routed experts, its memory terms, its guard (the ASGI middleware,
driven without a server), and the planner and rehearsal sizing the rollout side with it."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest

from megatron_dapo.config.run_config import load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.engines.registry import engine_spec
from megatron_dapo.engines.sglang.routes import RouteLayout
from megatron_dapo.engines.vllm.client import CompletionRequest, decode_routes
from megatron_dapo.engines.vllm.guard import RequireKey
from megatron_dapo.engines.vllm.memory import fit_mem_fraction, vllm_arch_terms
from megatron_dapo.launch.slurm import LaunchOptions, build_plan
from megatron_dapo.models.arch import load_arch
from tests.helpers import REPO

pytestmark = pytest.mark.timeout(120)

RECIPE_32B = str(REPO / "tests" / "slurm" / "recipes" / "sglang_32b.yaml")
VLLM = ("rollout.engine=vllm", "rollout.weight_sync=disk", "cluster.memory_check=false", "parallel.cp=1")


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("rollout.sampling.top_p=0.9", "rollout.sampling.top_p = 0.9: vLLM's logprobs are after top-p/top-k"),
        ("rollout.sampling.top_k=20", "rollout.sampling.top_k = 20: vLLM's logprobs"),
        ("rollout.vllm.tp=0", "rollout.vllm.tp = 0: must be >= 1"),
        ("rollout.vllm.env=[NOEQUALS]", "rollout.vllm.env = 'NOEQUALS': entries are KEY=VALUE"),
        ("rollout.vllm.python=/no/such/python", "rollout.vllm.python = '/no/such/python': no such interpreter"),
        (
            "rollout.vllm.args=[--data-parallel-size, 2]",
            "rollout.vllm.args = ['--data-parallel-size', '2']: no data-parallel",
        ),  # fmt: skip
        ("rollout.weight_sync=tensor", "rollout.weight_sync = 'tensor': rollout.engine = 'vllm' takes disk"),
    ],
)
def test_the_vllm_block_is_checked_naming_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("demo_cpu_vllm", [override])
    assert needle in str(e.value)


def test_another_engines_block_on_the_command_line_is_refused():
    with pytest.raises(ConfigError, match=r"rollout.sglang.tp = 2 would be ignored: rollout.engine = 'vllm'"):
        load_config("demo_cpu_vllm", ["rollout.sglang.tp=2"])
    with pytest.raises(ConfigError, match=r"rollout.vllm.tp = 2 would be ignored: rollout.engine = 'sglang'"):
        load_config("demo_cpu_sglang", ["rollout.vllm.tp=2"])


def test_dapo_launch_dry_run_places_vllm_servers_on_their_own_gpus():
    plan = build_plan(LaunchOptions(recipe=RECIPE_32B, overrides=[*VLLM, "rollout.vllm.tp=4"], nodes=2), env={},
                      dry_run=True)  # fmt: skip
    assert plan.servers and len(plan.servers) == 4  # 2 nodes x 8 GPUs / TP4
    gpus = set()
    for s in plan.servers:
        cmd = s.command
        assert cmd[:2] == ["env", cmd[1]] and cmd[1].startswith("CUDA_VISIBLE_DEVICES=")
        gpus.add((s.engine["node"], cmd[1]))
        assert "vllm.entrypoints.openai.api_server" in cmd and "--tensor-parallel-size" in cmd
        assert cmd[cmd.index("--tensor-parallel-size") + 1] == "4"
        assert "--enable-sleep-mode" in cmd  # colocated: weights and KV released while the trainer runs
        assert cmd[cmd.index("--worker-extension-cls") + 1].endswith("DapoWorkerExtension")
        assert cmd[cmd.index("--middleware") + 1].endswith("guard.RequireKey")
        assert "--api-key" not in cmd and cmd[-2] == "--config"  # the key only in the mode-0600 file
    assert {g for _, g in gpus} == {"CUDA_VISIBLE_DEVICES=0,1,2,3", "CUDA_VISIBLE_DEVICES=4,5,6,7"}
    assert len(gpus) == 4, "two servers per node, on distinct GPUs"


def test_the_request_is_token_ids_with_a_seed_and_the_sampled_tokens_logprob():
    req = CompletionRequest("r1", [1, 2], 8, 1.0, 1.0, -1, [0], 7, True, "/m")
    body = req.to_json()
    assert body["prompt"] == [1, 2] and body["max_tokens"] == 8 and body["seed"] == 7 and body["logprobs"] == 0
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"] and body["request_id"] == "r1"
    assert req.engine_id == "cmpl-r1-0"  # what /abort_requests takes (completion/serving.py:141,177)
    assert "seed" not in CompletionRequest("r2", [1], 8, 1.0, 1.0, -1, [], None, False, "/m").to_json()


def _npy(arr) -> str:
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode()


def test_routed_experts_are_read_for_the_moe_layers():
    layout = RouteLayout(num_layers=3, moe_layers=(1, 2), topk=2)
    every_layer = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2)
    routes = decode_routes(layout, _npy(every_layer), seq_len=5, rid="r")
    assert routes.shape == (4, 2, 2) and routes.dtype.is_signed and routes[0, 0].tolist() == [2, 3]
    assert decode_routes(layout, _npy(every_layer[:, 1:]), 5, "r").tolist() == routes.tolist()
    with pytest.raises(Exception, match="no routed experts"):
        decode_routes(layout, None, 5, "r")
    with pytest.raises(Exception, match=r"shape \(4, 3, 2\), expected \(5,"):
        decode_routes(layout, _npy(every_layer), 6, "r")


def test_memory_terms_add_up_and_the_fitted_fraction_fits():
    arch = load_arch("qwen2.5-32b")
    gpu = 79.65 * (1 << 30)
    m = vllm_arch_terms(arch, 8, gpu, 0.6)
    assert m.kv_tokens > 100_000 and m.weights == pytest.approx(2 * 32.76e9 / 8, rel=0.02)
    assert m.weights + m.kv_cache + m.activations <= 0.6 * gpu + 1
    room = 40 * (1 << 30)
    f = fit_mem_fraction(arch, 8, gpu, room, room)
    assert 0 < f < 0.6 and vllm_arch_terms(arch, 8, gpu, f).startup <= room
    assert vllm_arch_terms(arch, 8, gpu, f + 0.02).startup > room
    assert fit_mem_fraction(arch, 1, gpu, 20 * (1 << 30)) == 0.0  # 65 GB of weights on one GPU: nothing fits
    assert [r[0] for r in m.rows(8, "rollout")][:2] == ["vLLM weights", "vLLM KV cache"]
    spec = engine_spec("vllm")
    assert spec.memory(arch, 8, gpu, 0.6) == m and spec.fit_mem_fraction(arch, 8, gpu, room, room) == f


def test_the_planner_sizes_the_rollout_side_with_vllms_terms():
    from megatron_dapo.planning.planner import plan

    best = plan("qwen2.5-32b", 2048, 20480, 16, 8, 80, engine="vllm")[0]
    r = best.rollout
    assert best.feasible and r.tp_key == "rollout.vllm.tp" and type(r.engine_terms).__name__ == "VLLMMemory"
    assert r.engine_terms.mem_fraction == r.mem_fraction and r.engine_terms.kv_tokens == r.kv_tokens
    assert r.engine_terms.weights + r.engine_terms.kv_cache == r.share


def _call(app, path: str, auth: str | None) -> int:
    sent = []

    async def receive():
        return {"type": "http.request"}

    async def send(message):
        sent.append(message)

    headers = [(b"authorization", auth.encode())] if auth is not None else []
    asyncio.run(app({"type": "http", "path": path, "headers": headers}, receive, send))
    return sent[0]["status"]


def test_the_guard_wants_the_key_everywhere_but_the_probes():
    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    guard = RequireKey(inner, key="k3y")
    for path in ("/collective_rpc", "/pause", "/resume", "/abort_requests", "/v1/completions", "/sleep"):
        assert _call(guard, path, None) == 401
        assert _call(guard, path, "Bearer wrong") == 401
        assert _call(guard, path, "Basic k3y") == 401
        assert _call(guard, path, "Bearer k3y") == 200
    assert _call(guard, "/health", None) == 200


def test_the_server_interpreter_decides_whether_vllm_is_installed(tmp_path):
    """rollout.fallback_hf asks the servers' interpreter (vLLM has its own venv on a CPU), not the trainer's."""
    spec = engine_spec("vllm")
    cfg = load_config("demo_cpu", ["rollout.engine=vllm", "rollout.weight_sync=disk", "rollout.vllm.device=cpu",
                                   "rollout.colocate=false"])  # fmt: skip
    fake = tmp_path / "python"
    for finds, code in ((True, 0), (False, 1)):
        fake.write_text(f"#!/bin/sh\nexit {code}\n")
        fake.chmod(0o755)
        cfg.rollout.vllm.python = str(fake)
        assert spec.installed(cfg) is finds
    cfg.rollout.vllm.python = str(tmp_path / "missing")
    assert spec.installed(cfg) is False
    assert engine_spec("hf").installed(cfg)
