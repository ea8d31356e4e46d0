"""Where SGLang servers run and what they free: colocated servers release their CUDA graphs too (both places one is
started: the Slurm launcher's task and the trainer's own start), and the trainer never starts an uncolocated server
on its own GPUs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_dapo.config.run_config import load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.launch.slurm import LaunchOptions, build_plan
from tests.helpers import REPO

pytestmark = pytest.mark.timeout(120)

GRAPHS = "SGLANG_MEMORY_SAVER_CUDA_GRAPH"  # sglang 0.5.23 srt/environ.py: graphs join the memory saver only with it
RECIPE_32B = str(REPO / "tests" / "slurm" / "recipes" / "sglang_32b.yaml")
SMALL = ("cluster.memory_check=false", "parallel.cp=1")  # two nodes, 8 GPUs each


def _task_env(srun: list[str]) -> dict[str, str]:
    """The variables a server task's ``srun --export=ALL,K=V,...`` sets."""
    (export,) = [a for a in srun if a.startswith("--export=")]
    return dict(kv.split("=", 1) for kv in export.removeprefix("--export=").split(",")[1:])


# SGLang's default prefill CUDA graphs (the breakable backend) refuse the memory saver with GRAPHS set: a colocated
# CUDA server must turn them off (engines/sglang/server.py PLATFORMS["cuda"])
PREFILL_GRAPHS_OFF = "--disable-prefill-cuda-graph"


def test_sglang_takes_the_flag_and_its_breakable_prefill_graphs_refuse_the_memory_saver():
    """The real package: the flag parses, and the backend it turns off raises under the memory saver (read from its
    source: importing the backend needs torchvision and CUDA)."""
    import argparse
    import importlib.util
    import os
    from pathlib import Path

    if importlib.util.find_spec("sglang") is None:
        if os.environ.get("DAPO_REQUIRE_SGLANG") == "1":
            pytest.fail("sglang is not installed (DAPO_REQUIRE_SGLANG=1)")
        pytest.skip("sglang is not installed")
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--model-path", "m", PREFILL_GRAPHS_OFF]).disable_prefill_cuda_graph is True
    root = Path(importlib.util.find_spec("sglang").origin).parent / "srt" / "model_executor"
    src = (root / "runner_backend" / "breakable_cuda_graph_backend.py").read_text()
    assert "SGLANG_MEMORY_SAVER_CUDA_GRAPH" in src and "not compatible with memory saver" in src
    assert "return Backend.BREAKABLE if is_cuda()" in (root / "cuda_graph_config.py").read_text()


def _plan(*overrides: str):
    opts = LaunchOptions(recipe=RECIPE_32B, overrides=[*SMALL, *overrides], nodes=2)
    return build_plan(opts, env={}, dry_run=True)


def test_colocated_slurm_servers_release_their_cuda_graphs():
    plan = _plan()
    assert plan.placement == "colocated" and plan.servers
    for s in plan.servers:
        assert "--enable-memory-saver" in s.command and PREFILL_GRAPHS_OFF in s.command
        assert _task_env(s.srun)[GRAPHS] == "1", s.srun
    # disaggregated servers never sleep: neither the memory saver nor its variable
    plan = _plan("cluster.placement=disaggregated", "cluster.rollout_nodes=1", "rollout.colocate=false",
                 "rollout.weight_sync=distributed")  # fmt: skip
    for s in plan.servers:
        assert "--enable-memory-saver" not in s.command and GRAPHS not in _task_env(s.srun)
        assert PREFILL_GRAPHS_OFF not in s.command
    # rollout.sglang.env still has the last word
    plan = _plan(f"rollout.sglang.env=[{GRAPHS}=0]")
    assert {_task_env(s.srun)[GRAPHS] for s in plan.servers} == {"0"}


def _local_server(*overrides: str):
    from megatron_dapo.engines.sglang.client import SGLangEngine

    cfg = load_config(RECIPE_32B, list(overrides))
    (server,) = SGLangEngine.from_config(cfg, "/models/unused", start=False).servers
    return server


def test_the_trainers_own_colocated_server_releases_its_cuda_graphs(tmp_path, monkeypatch):
    monkeypatch.delenv(GRAPHS, raising=False)
    server = _local_server()  # the trainer's own start (no rollout.server_urls), colocated on CUDA
    assert "--enable-memory-saver" in server.argv() and server.env[GRAPHS] == "1"
    assert PREFILL_GRAPHS_OFF in server.argv()
    # the process it starts gets it: a stand-in launcher prints what it sees
    server.launcher = [sys.executable, "-c", f"import os; print('graphs=' + os.environ.get('{GRAPHS}', 'unset'))"]
    server.log_path = tmp_path / "server.log"
    server.args_file = tmp_path / "server.args.yaml"
    server.start()
    try:
        server.proc.wait(timeout=60)
    finally:
        server.stop()
    assert "graphs=1" in server.log_path.read_text()
    # not colocated (servers on other GPUs) and CPU servers: no memory saver, no variable
    cpu = _local_server("rollout.sglang.device=cpu", "rollout.sglang.deterministic=false", "rollout.colocate=false")
    assert "--enable-memory-saver" not in cpu.argv() and GRAPHS not in cpu.env


UNCOLOCATED = ("rollout.colocate=false", "rollout.weight_sync=distributed")


@pytest.mark.parametrize("extra", [(), ("rollout.schedule=one_step_off",)])
def test_an_uncolocated_gpu_server_the_trainer_would_start_itself_is_refused(extra):
    with pytest.raises(ConfigError) as e:
        load_config("dapo_7b", ["model.hf_init=/m", *UNCOLOCATED, *extra])
    msg = str(e.value)
    assert "rollout.colocate = False" in msg and "on its own GPUs" in msg
    for key in ("rollout.server_urls=", "cluster.placement=disaggregated", "rollout.colocate=true"):
        assert key in msg, key
    # what stays accepted: servers given by URL, the launcher's disaggregated job, CPU servers, colocated servers
    load_config("dapo_7b", ["model.hf_init=/m", *UNCOLOCATED, *extra, 'rollout.server_urls=["http://gpu9:30000"]'])
    load_config("dapo_7b", ["model.hf_init=/m", *UNCOLOCATED, *extra, "cluster.nodes=2",
                            "cluster.placement=disaggregated", "cluster.rollout_nodes=1"])  # fmt: skip
    load_config("demo_cpu_sglang", ["rollout.colocate=false", *extra])
    # a server the user points at other GPUs: one node's async with the trainer on GPUs 0-3 and SGLang on 4-7
    load_config("dapo_7b", ["model.hf_init=/m", *UNCOLOCATED, *extra, "rollout.sglang.args=[--base-gpu-id,4]"])
    load_config("dapo_7b", ["model.hf_init=/m", *UNCOLOCATED, *extra, "rollout.sglang.env=[CUDA_VISIBLE_DEVICES=4]"])
    if not extra:
        load_config("dapo_7b", ["model.hf_init=/m", "rollout.colocate=true", "rollout.weight_sync=tensor"])


def test_dapo_train_refuses_it_before_starting_anything(tmp_path):
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "train", "--recipe", "dapo_7b", "model.hf_init=/m", *UNCOLOCATED,
           "rollout.schedule=one_step_off", f"train.run_dir={tmp_path}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "rollout.colocate = False" in proc.stderr and "rollout.server_urls=" in proc.stderr
    assert not list(tmp_path.iterdir())  # no run directory, no server log


AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"  # an AMD EPYC of this machine's kind
SAPPHIRE = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_rollout_dtype_auto_is_bf16_only_where_bf16_is_fast(monkeypatch):
    """auto = bf16 on GPUs and on CPUs with bf16 units, fp32 elsewhere (bf16 linears ran 5.1x slower than fp32 on
    an AVX2-only CPU); both places a server is started use it: the trainer's own server and dapo launch's command."""
    from megatron_dapo.engines.sglang import server as srv

    assert not srv.cpu_has_bf16_units(AVX2_ONLY) and srv.cpu_has_bf16_units(SAPPHIRE)
    assert not srv.cpu_has_bf16_units("flags\t\t: avx512f\nbugs\t\t: amx_bf16\n")  # only the flags line counts
    cpu = ("rollout.sglang.device=cpu", "rollout.sglang.deterministic=false", "rollout.colocate=false")
    for info, want in ((AVX2_ONLY, "float32"), (SAPPHIRE, "bfloat16")):
        monkeypatch.setattr(srv, "cpu_has_bf16_units", lambda info=info: srv.BF16_CPU_FLAGS[0] in info)
        server = _local_server(*cpu, "rollout.dtype=auto")
        assert server.argv()[server.argv().index("--dtype") + 1] == want
    assert "--dtype float32" in " ".join(_local_server(*cpu, "rollout.dtype=fp32").argv())  # explicit wins
    # GPUs: bf16 whatever the host CPU; the Slurm launcher writes the same
    gpu = _local_server("rollout.dtype=auto")
    assert gpu.argv()[gpu.argv().index("--dtype") + 1] == "bfloat16"
    for s in _plan("rollout.dtype=auto").servers:
        assert s.command[s.command.index("--dtype") + 1] == "bfloat16"
