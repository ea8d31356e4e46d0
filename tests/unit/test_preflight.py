"""Build 4 of issue 22: the start-up preflight (``megatron_dapo/launch/preflight.py``) of ``dapo train`` and ``dapo launch``.
The checks are pure functions over probed facts: GPU environments are faked here; this CPU environment's real facts
pass silently for the CPU recipes."""

from __future__ import annotations

import sys

import pytest

from megatron_dapo.config.run_config import load_config
from megatron_dapo.launch.preflight import FIX_ENV, Facts, PreflightError, check, needs_for, probe, train_preflight
from megatron_dapo.versions import MCORE_RANGE
from tests.helpers import fake_allocation_srun

GPU_OK = Facts("2.8.0", "12.8", 8, "0.19.2", {"transformer_engine.pytorch": None, "sglang": None, "sgl_kernel": None})
CPU = Facts("2.13.0+cpu", None, 0, "0.16.1", {})


def _gpu_job(*overrides: str):
    return needs_for(load_config("dapo_7b", ["model.hf_init=/m", *overrides]), 8, True, "8 trainer ranks")


def test_a_cpu_run_passes_silently_on_this_machines_real_facts(capsys):
    for recipe in ("demo_cpu", "demo_cpu_sglang", "chain_cpu", "grpo_cpu"):
        cfg = load_config(recipe)
        assert check(needs_for(cfg), probe(needs_for(cfg))) == []
        train_preflight(cfg, {"RANK": "0", "LOCAL_WORLD_SIZE": "2"})
    assert capsys.readouterr() == ("", "")


def test_a_complete_gpu_stack_passes():
    assert check(_gpu_job("model.fp8=e4m3"), GPU_OK) == []


def test_each_failed_check_is_one_line_naming_the_fix():
    facts = Facts("2.8.0", "12.8", 4, "0.15.0", {"transformer_engine.pytorch": "ImportError: libcudnn.so.9",
                                                 "sglang": None, "sgl_kernel": "OSError: undefined symbol _ZN3c10"})  # fmt: skip
    lines = check(_gpu_job("model.fp8=e4m3"), facts)
    assert len(lines) == 4, lines
    mcore, gpus, te, kernel = lines
    assert f"megatron-core 0.15.0 is outside the supported range {MCORE_RANGE}" in mcore and "pip install" in mcore
    assert "this node shows 4 CUDA devices, the layout needs 8 per node (8 trainer ranks)" in gpus
    assert "Transformer Engine is not importable (ImportError: libcudnn.so.9), but model.fp8 = 'e4m3'" in te
    assert "transformer-engine[pytorch]" in te
    assert "sgl-kernel) not importable (OSError: undefined symbol" in kernel and FIX_ENV in kernel


def test_a_cpu_torch_for_a_cuda_job_names_the_environment_to_use():
    (line,) = check(_gpu_job(), CPU)
    assert line.startswith("torch 2.13.0+cpu is a CPU build, but the job runs on CUDA devices (rollout.engine = ")
    assert "PYTHON=" in line and "cluster.container_image=" in line


def test_te_is_needed_only_where_the_spec_asks_for_it():
    no_te = {**GPU_OK.imports, "transformer_engine.pytorch": "ModuleNotFoundError: transformer_engine"}
    facts = Facts("2.8.0", "12.8", 8, "0.19.2", no_te)
    cfg = ["parallel.cp=1", "parallel.sequence_parallel=false", "model.fp8=null", "model.transformer_impl=local"]
    assert check(_gpu_job(*cfg), facts) == []
    assert "parallel.cp = 2 (TE's context-parallel attention)" in check(_gpu_job("parallel.cp=2"), facts)[0]
    assert check(needs_for(load_config("demo_cpu", ["parallel.cp=2"])), CPU) == []  # a CPU run: not checked


def test_dapo_train_refuses_before_building_anything(monkeypatch, capsys):
    import megatron_dapo.loop.trainer as trainer
    from megatron_dapo import cli
    from megatron_dapo.launch import preflight

    monkeypatch.setattr(trainer, "Trainer", lambda *a, **k: pytest.fail("the trainer was built"))
    monkeypatch.setattr(preflight, "probe", lambda needs=None: CPU)  # this machine, as a GPU job sees it
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    rc = cli.main(["train", "--recipe", "dapo_7b", "model.hf_init=/m"])
    err = capsys.readouterr().err
    assert rc == 2 and "dapo train: preflight: this environment cannot run the job:\n  - torch 2.13.0+cpu" in err


def test_dapo_launch_refuses_before_any_job_step(tmp_path, monkeypatch, capsys):
    from megatron_dapo.launch import preflight
    from megatron_dapo.launch.slurm import main

    monkeypatch.setattr(preflight, "probe", lambda needs=None: CPU)  # this machine (its sglang import: 15 s)

    calls = fake_allocation_srun(tmp_path, monkeypatch)
    small = ["model.hf_init=/m", "parallel.tp=4", "rollout.sglang.tp=8", "cluster.memory_check=false"]
    rc = main(["--recipe", "dapo_7b", "--log-dir", str(tmp_path / "logs"), "--python", sys.executable, *small])
    err = capsys.readouterr().err
    assert rc == 2 and "dapo launch: preflight" in err and "is a CPU build" in err, err
    assert not calls.exists()


def test_the_tensor_sync_reach_is_checked_on_rank_0_outside_dapo_launch():
    cfg = load_config("demo_cpu_sglang", ['rollout.server_urls=["http://192.0.2.7:1"]'])
    with pytest.raises(Exception, match="not on this node"):
        train_preflight(cfg, {"RANK": "0"})
    train_preflight(cfg, {"RANK": "1"})  # only rank 0 sends
    train_preflight(cfg, {"RANK": "0", "DAPO_LOCAL_SERVER_URL": "http://192.0.2.7:1"})  # dapo launch: per node


def test_preflight_errors_are_config_errors():
    from megatron_dapo.config.typed_yaml import ConfigError

    assert issubclass(PreflightError, ConfigError)


def test_dapo_launch_probes_the_interpreter_its_steps_run(tmp_path):
    from megatron_dapo.launch.preflight import probe_python

    other = tmp_path / "python"  # another interpreter (here this one behind a wrapper): probed in its own process
    other.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    other.chmod(0o755)
    facts = probe_python(str(other), needs_for(load_config("demo_cpu", ["model.transformer_impl=transformer_engine"])))
    assert (facts.torch_cuda, facts.cuda_devices, facts.mcore) == (None, 0, "0.16.1")
    assert facts.imports["transformer_engine.pytorch"].startswith("ModuleNotFoundError")  # what the needs asked
    with pytest.raises(PreflightError, match=r"/usr/bin/false -m megatron_dapo\.launch\.preflight failed"):
        probe_python("/usr/bin/false", needs_for(load_config("demo_cpu")))


def test_the_megatron_core_range_reads_versions_as_pip_does():
    from megatron_dapo.versions import in_range

    for ok in ("0.16.1", "0.19.2", "0.19.2+cu13", "0.19.3rc1", "0.17.0.dev0"):
        assert in_range(ok, MCORE_RANGE), ok
    for out in ("0.16.0", "0.16.1rc1", "0.20.0", "0.20.0rc0", "1.0"):  # a pre-release is below its release
        assert not in_range(out, MCORE_RANGE), out
    with pytest.raises(ValueError, match="not a version: 'main'"):
        in_range("main", MCORE_RANGE)
