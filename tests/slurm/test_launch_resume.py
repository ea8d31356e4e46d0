"""The driver's side of long jobs, without a Slurm cluster: resume flags, the stop relay and its exit code, the port
plan, the health wait that scales with the model. (The same against a real Slurm: test_slurm_requeue.py.)"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_dapo.config.run_config import load_config
from megatron_dapo.launch.health import health_timeout_s
from megatron_dapo.launch.slurm import LaunchError, LaunchOptions, Supervisor, build_plan
from megatron_dapo.models.arch import load_arch
from megatron_dapo.models.memory import total_params
from megatron_dapo.ports import JobPorts, find_collisions
from megatron_dapo.runs import EXIT_RESUMABLE
from tests.slurm.conftest import HERE, TEST_RECIPE_32B, free_port

R32 = str(TEST_RECIPE_32B)
STUB = f"{{python}} {HERE}/stop_probe.py"


def plan_for(*overrides: str, env: dict | None = None, **opts):
    return build_plan(LaunchOptions(recipe=R32, overrides=list(overrides), **opts), env=env or {}, dry_run=True)


# one TP8 engine per node; these 32B layouts on 1-2 nodes are predicted not to fit (never run here)
ONE_ENGINE = ("parallel.cp=1", "rollout.sglang.tp=8", "cluster.memory_check=false")


def test_trainer_resumes_by_default():
    for resume, opts in (("auto", {}), ("none", {"resume": "none"})):
        command = plan_for(nodes=2, **opts).trainer.command
        assert command.count("--resume") == 1 and command[command.index("--resume") + 1] == resume


def test_two_jobs_on_the_same_nodes_use_disjoint_ports(monkeypatch):
    # node names are their addresses here (scontrol, without a cluster, can spend seconds on DNS before it fails)
    monkeypatch.setattr("megatron_dapo.launch.slurm.node_address", lambda node: node)
    env = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_GPUS_ON_NODE": "8"}
    used = []
    for job in ("4242", "4243"):
        plan = build_plan(LaunchOptions(recipe=R32, overrides=ONE_ENGINE), env={**env, "SLURM_JOB_ID": job})
        ports = JobPorts(plan.port_base)
        assert plan.env["DAPO_PORT_BASE"] == str(ports.base) and plan.master_port == ports.rendezvous
        assert all(s.url.endswith(f":{ports.server(0).http}") for s in plan.servers)
        assert all(s.command[s.command.index("--nccl-port") + 1] == str(ports.server(0).nccl) for s in plan.servers)
        used.append({ports.rendezvous, ports.router, ports.weight_sync, *ports.server(0).all()})
    assert not used[0] & used[1]


def test_pinned_ports_that_collide_are_refused():
    port = free_port()
    with pytest.raises(LaunchError, match=rf"server node1 GPU 0 \(HTTP\) and rendezvous both use port {port} on node1"):
        plan_for(*ONE_ENGINE, f"cluster.master_port={port}", f"cluster.server_port={port}", nodes=1)
    assert find_collisions({"a": ("n1", port), "b": ("n2", port)}) == []  # other hosts: no clash


def test_health_wait_scales_with_model_and_servers():
    cfg = load_config(R32)
    weights = total_params(load_arch("qwen2.5-32b")) * 2  # bf16
    assert weights > 60e9
    # 16 nodes, two TP4 servers each, every one reading the whole model
    plan = plan_for(nodes=16)
    assert plan.health_timeout_s == pytest.approx(600 + 2 * 32 * weights / 2e9) == health_timeout_s(cfg, 32)
    assert plan.health_timeout_s > 1500  # was a flat 600 s
    assert plan_for(nodes=16, health_timeout_s=90).health_timeout_s == 90


def _stub_plan(tmp_path: Path, steps: int, **extra):
    """A CPU plan (no servers) whose trainer is stop_probe.py: it waits for its stop file, then 'saves' a step."""
    run = tmp_path / "runs"
    plan = plan_for("rollout.engine=hf", "rollout.weight_sync=copy", "parallel.tp=1", "parallel.cp=1",
                    f"train.run_dir={run}", "train.name=t", f"train.steps={steps}", nodes=1,
                    log_dir=str(tmp_path / "logs"), **extra)  # fmt: skip
    # no srun here: the stub runs as the step itself, with the step's environment
    plan.trainer.srun = [sys.executable, f"{HERE}/stop_probe.py", "--run-dir", plan.run_dir, "--wait-s", "60"]
    return plan


def when_trainer_started(sup: Supervisor, action, timeout: float = 50) -> threading.Thread:
    """Run ``action`` once the supervisor has started its trainer step, so after it installed its SIGUSR1 handler and
    removed a stale stop file: a signal sent after a fixed delay would end pytest itself (the default action of
    SIGUSR1) on a machine slow enough that the handler is not there yet."""

    def wait_then_act():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(step.role == "trainer" for step, _proc, _log in list(sup.procs)):
                action()
                return
            time.sleep(0.02)

    thread = threading.Thread(target=wait_then_act, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(60)
@pytest.mark.parametrize("steps, code", [(5, EXIT_RESUMABLE), (1, 0)])
def test_sigusr1_reaches_the_trainer_and_the_exit_code_says_resumable(tmp_path, steps, code):
    """SIGUSR1 to the driver -> the trainer's stop file -> the trainer saves step 1 and exits 0 -> the driver exits 75
    while steps remain, 0 when that was the last one."""
    plan = _stub_plan(tmp_path, steps)
    Path(plan.stop_file).parent.mkdir(parents=True)
    Path(plan.stop_file).write_text("stale: a request of an earlier allocation\n")
    lines: list[str] = []
    sup = Supervisor(plan, poll_s=0.05)
    sup.say = lines.append
    when_trainer_started(sup, lambda: os.kill(os.getpid(), signal.SIGUSR1))
    assert sup.run() == code, "\n".join(lines)
    text = "\n".join(lines)
    assert "stop requested (SIGUSR1): the trainer saves after its current step and stops" in text
    assert Path(plan.run_dir, "checkpoints", "step_000001", "dapo_meta.json").is_file()
    probe = Path(plan.run_dir, "probe.log").read_text()
    assert "waited" in probe and "stale" not in probe  # the stale request was removed before the trainer started
    if code:
        assert f"step 1 of {steps} is saved" in text and "exit code 75 (resumable)" in text
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the driver's handler is gone


@pytest.mark.timeout(60)
def test_signal_file_of_the_batch_shell_is_relayed(tmp_path, monkeypatch):
    """slurm/common.sh touches $DAPO_SIGNAL_FILE when the batch shell gets SIGUSR1; the driver polls it."""
    signal_file = tmp_path / "batch-signal"
    monkeypatch.setenv("DAPO_SIGNAL_FILE", str(signal_file))
    plan = _stub_plan(tmp_path, 3)
    lines: list[str] = []
    sup = Supervisor(plan, poll_s=0.05)
    sup.say = lines.append
    when_trainer_started(sup, signal_file.touch)
    assert sup.run() == EXIT_RESUMABLE, "\n".join(lines)
    assert "stop requested (SIGUSR1 to the batch script)" in "\n".join(lines)


@pytest.mark.timeout(60)
def test_health_wait_reports_progress(tmp_path, python):
    port = free_port()
    server = f"{{python}} {HERE}/fake_sglang_server.py --port {{port}} --node {{node}} --load-s 1.5"
    plan = plan_for(*ONE_ENGINE, f"cluster.server_port={port}", nodes=1, log_dir=str(tmp_path / "logs"),
                    server_cmd=server)  # fmt: skip
    step = plan.servers[0]  # no srun here: the program runs as the step, its output goes to the step's srun log
    step.srun, step.url, step.log = step.command, f"http://127.0.0.1:{port}", f"{plan.log_dir}/{step.name}.srun.log"
    plan.trainer.srun = [python, "-c", "pass"]
    lines: list[str] = []
    sup = Supervisor(plan, poll_s=0.05, report_s=0.5)
    sup.say = lines.append
    assert sup.run() == 0, "\n".join(lines)
    reports = [line for line in lines if "servers healthy after" in line]
    assert reports, lines
    assert reports[0].startswith("0/1 servers healthy after ")
    assert (
        f"of {plan.health_timeout_s:.0f} s); waiting for\n    node1 (http://127.0.0.1:{port}): Loading " in reports[0]
    )


def test_end_time_watch_stops_before_the_limit(tmp_path, monkeypatch):
    """A driver run as a job step (nemo-run) reads the job's end from scontrol and stops the trainer in time."""
    from megatron_dapo.launch import stop

    end = {"t": time.time() + 500}
    monkeypatch.setattr(stop, "job_end_time", lambda job_id: end["t"] if job_id == "77" else None)
    said: list[str] = []
    relay = stop.StopRelay(tmp_path / "stop", tmp_path / "ckpt", 10, said.append, job_id="77", stop_before_s=120)
    relay.poll()
    assert relay.reason is None and not (tmp_path / "stop").exists()
    end["t"] = time.time() + 100  # e.g. `scontrol update TimeLimit=...` shortened it; re-read every 60 s
    relay._end_checked -= 61
    relay.poll()
    assert relay.reason.startswith("the time limit is ") and (tmp_path / "stop").read_text().startswith("the time")
    assert relay.exit_code() == EXIT_RESUMABLE  # nothing saved yet: step 0 of 10
    assert (
        stop.StopRelay(tmp_path / "s2", tmp_path, 10, said.append, job_id=None, stop_before_s=120)._near_time_limit()
        is None
    )
