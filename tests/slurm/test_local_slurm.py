"""Against a real local Slurm (two emulated nodes n1, n2 with 8 fake GPUs): sbatch scripts, the driver, fail fast."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from megatron_dapo.launch.slurm import expand_nodelist
from tests.helpers import REPO, skip_unless_required
from tests.slurm.conftest import HERE, SCRIPT, TEST_RECIPE_32B, free_port_base, process_running
from tests.slurm.test_sbatch_inputs import make_inputs

pytestmark = pytest.mark.slurm

DRIVER = [sys.executable, "-m", "megatron_dapo.launch.slurm"]
FAKE_SERVER = f"{{python}} {HERE}/fake_sglang_server.py --port {{port}}"
PROBE = f"{{python}} {HERE}/rank_probe.py --server-urls {{server_urls}}"


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the two emulated nodes share 127.0.0.1, so their servers get p and p + 1)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            return p
    raise RuntimeError("no free port pair")


def recipe_32b() -> str:
    """The real dapo_32b recipe when it exists, else the test copy of its shape."""
    real = REPO / "megatron_dapo" / "recipes" / "dapo_32b.yaml"
    return "dapo_32b" if real.is_file() else str(TEST_RECIPE_32B)


def read_ranks(out: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in out.glob("rank-*.json")), key=lambda r: int(r["RANK"]))


def read_safetensors_dir(path: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def wait_dead(pids: list[int], timeout: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(map(process_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if process_running(p)]


@pytest.mark.timeout(120)
def test_cluster_has_two_nodes_with_fake_gpus(local_slurm):
    out = local_slurm.run("sinfo", "-h", "-N", "-o", "%N %T %G").stdout.split("\n")
    assert sorted(line.strip() for line in out if line.strip()) == ["n1 idle gpu:8", "n2 idle gpu:8"]
    out = local_slurm.run("srun", "-N2", "--gpus-per-node=8", "--ntasks-per-node=1", "printenv", "CUDA_VISIBLE_DEVICES")
    assert out.stdout.split() == ["0,1,2,3,4,5,6,7"] * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", ["n[1-2]", "gpu[08-10,12],login", "r[1-2]n[1-3]", "a,b[01-02]"])
def test_expand_nodelist_matches_scontrol(local_slurm, spec):
    assert expand_nodelist(spec) == local_slurm.run("scontrol", "show", "hostnames", spec).stdout.split()


@pytest.mark.timeout(120)
def test_sbatch_scripts_are_accepted(local_slurm):
    for script, extra in [("dapo_32b.sbatch", ["--nodes=2"]), ("dapo_7b.sbatch", ["--nodes=2"]),
                          ("dapo_qwen3_32b.sbatch", ["--nodes=2"]), ("dapo_tiny_cpu.sbatch", [])]:  # fmt: skip
        out = local_slurm.run("sbatch", "--test-only", *extra, f"slurm/{script}", check=False)
        assert out.returncode == 0 and "to start at" in out.stderr and "n[1-2]" in out.stderr, (script, out.stderr)
    # the scheduler really checks the request: the 32B script's own 16 nodes do not fit the 2-node test cluster
    out = local_slurm.run("sbatch", "--test-only", "slurm/dapo_32b.sbatch", check=False)
    assert out.returncode != 0 and "node configuration is not available" in out.stderr


@pytest.mark.timeout(120)
def test_32b_sbatch_dry_run_inside_allocation(local_slurm, tmp_path):
    """The real dapo_32b.sbatch on 2 emulated GPU nodes, with --dry-run: the plan names 32B, the sizes, the servers."""
    # 32B on 2 nodes (DP 1) is predicted not to fit an 80 GiB GPU: the driver would refuse it; this checks the plan
    args = ["--dry-run", "--json", "cluster.memory_check=false"]
    args += [] if recipe_32b() == "dapo_32b" else ["--recipe", recipe_32b()]
    inputs = make_inputs(tmp_path / "inputs")  # checked in the job before the driver starts
    job = local_slurm.submit("--nodes=2", f"--output={tmp_path}/out", f"--error={tmp_path}/err",
                             "slurm/dapo_32b.sbatch", *args, env={**local_slurm.env, **inputs})  # fmt: skip
    state, code, _ = local_slurm.wait(job, 60)
    err = (tmp_path / "err").read_text()
    assert state == "COMPLETED", f"{state} {code}\n{err}"
    plan = json.loads((tmp_path / "out").read_text())
    assert plan["model"] == "qwen2.5-32b" and plan["job_id"] == job
    assert plan["nodes"] == ["n1", "n2"] and plan["gpus_per_node"] == 8 and plan["world_size"] == 16
    # the sizes the script sets (chosen by the planner) and the data-parallel size they leave on 2 nodes
    assert (plan["tp"], plan["pp"], plan["cp"]) == (8, 2, 1) and plan["dp"] == 16 // (8 * 2 * 1)
    assert plan["master_addr"] == "127.0.0.1"  # n1's NodeAddr, asked from scontrol
    servers = plan["servers"]
    # one SGLang server per rollout-TP group: two TP4 engines per 8-GPU node, at base GPUs 0 and 4
    assert [s["nodes"] for s in servers] == [[n] for n in plan["rollout_nodes"] for _ in (0, 4)] and servers
    assert [s["engine"]["base_gpu_id"] for s in servers] == [0, 4, 0, 4]
    for s in servers:
        cmd = " ".join(s["command"])
        assert f"-m sglang.launch_server --model-path {inputs['HF_CKPT']}" in cmd
        assert "--tp-size 4" in cmd and "--dp-size" not in cmd and "--mem-fraction-static 0.6 " in cmd
        assert "--enable-memory-saver --disable-prefill-cuda-graph" in cmd  # colocated: no breakable prefill graphs
        assert f"--base-gpu-id {s['engine']['base_gpu_id']}" in cmd
        assert "--enable-deterministic-inference" in cmd and "--enable-memory-saver" in cmd
        assert "--export=ALL,SGLANG_RETURN_ORIGINAL_LOGPROB=0,SGLANG_MEMORY_SAVER_CUDA_GRAPH=1" in s["srun"]
    assert "== launch (recipe dapo_32b)" in err and "ended with exit code 0" in err


# stand-in servers: one TP8 engine per node, 32B "trained" by stand-in ranks (its memory check is for real GPUs)
ONE_ENGINE_PER_NODE = ("rollout.sglang.tp=8", "cluster.memory_check=false")


def _salloc(local_slurm, *driver_args: str, gpus: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    alloc = ["salloc", "-N2", "--exclusive", "--ntasks-per-node=1"] + (["--gpus-per-node=8"] if gpus else [])
    return local_slurm.run(*alloc, *DRIVER, *driver_args, timeout=timeout, check=False)


@pytest.mark.timeout(180)
def test_colocated_servers_then_trainer(local_slurm, tmp_path):
    """Servers on both nodes become healthy, then 2 x 2 trainer ranks see the right env and reach every server."""
    port = free_port_pair()
    pids, ranks, logs = tmp_path / "pids", tmp_path / "ranks", tmp_path / "logs"
    out = _salloc(local_slurm, "--recipe", str(TEST_RECIPE_32B), *ONE_ENGINE_PER_NODE, "parallel.tp=2", "parallel.cp=1",
                  f"cluster.server_port={port}", "--ntasks-per-node", "2", "--log-dir", str(logs),
                  "--server-cmd", f"{FAKE_SERVER} --pid-dir {pids}",
                  "--trainer-cmd", f"{PROBE} --out {ranks} --log-dir {logs}")  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    recs = read_ranks(ranks)
    assert [r["RANK"] for r in recs] == ["0", "1", "2", "3"]
    assert [(r["node"], r["LOCAL_RANK"], r["NODE_RANK"]) for r in recs] == [
        ("n1", "0", "0"), ("n1", "1", "0"), ("n2", "0", "1"), ("n2", "1", "1")]  # fmt: skip
    assert {(r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["MASTER_ADDR"]) for r in recs} == {("4", "2", "127.0.0.1")}
    assert all(r["servers"] == {u: 200 for u in urls} for r in recs)
    assert [r["DAPO_LOCAL_SERVER_URL"] for r in recs] == [urls[0], urls[0], urls[1], urls[1]]  # own node's server
    # one API key for the job, in every rank's environment, in the 0600 args file only (removed at the end)
    assert len({r["api_key_sha256"] for r in recs}) == 1 and recs[0]["api_key_sha256"]
    assert {r["args_file_mode"] for r in recs} == {"0o600"} and all(r["key_in"] == ["sglang-args.yaml"] for r in recs)
    assert not (logs / "sglang-args.yaml").exists()
    assert f"server http://127.0.0.1:{port} is healthy" in out.stderr
    assert {p.name for p in logs.iterdir()} >= {"server-n1.log", "server-n2.log", "trainer-0.log", "plan.json"}
    server_pids = [int(p.read_text()) for p in pids.glob("*.pid")]
    assert len(server_pids) == 2 and not wait_dead(server_pids), "servers still running after the trainer finished"


@pytest.mark.timeout(120)
def test_rollout_server_failure_ends_job_within_60s(local_slurm, tmp_path):
    """A job whose server on n2 crashes (after becoming healthy) ends fast, non-zero, naming n2 and its log."""
    port = free_port_pair()
    pids, logs = tmp_path / "pids", tmp_path / "logs"
    script = tmp_path / "job.sbatch"
    server = f"{FAKE_SERVER} --pid-dir {pids} --fail-on n2 --fail-after 3"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=2 --gpus-per-node=8 --ntasks-per-node=1 --exclusive
#SBATCH --output={tmp_path}/job.out
source {REPO}/slurm/common.sh
phase launch
dapo_launch --recipe {TEST_RECIPE_32B} {" ".join(ONE_ENGINE_PER_NODE)} parallel.tp=2 parallel.cp=1 \\
    cluster.server_port={port} --ntasks-per-node 1 \\
    --log-dir {logs} --server-cmd '{server}' --trainer-cmd 'sleep 300'
""")
    t0 = time.monotonic()
    job = local_slurm.submit(str(script))
    state, code, _ = local_slurm.wait(job, 90)
    elapsed = time.monotonic() - t0
    text = (tmp_path / "job.out").read_text()
    assert state == "FAILED" and code == "1:0", f"{state} {code}\n{text}"
    assert elapsed < 60, f"the job took {elapsed:.0f} s to fail"
    assert f"rollout server on node n2 (step dapo-server-n2) exited with code 1; log: {logs}/server-n2.log" in text
    assert "simulated crash" in text  # the tail of the server's log
    assert "FAILED in phase launch" in text  # common.sh's trap
    assert not wait_dead([int((pids / "server-n1.pid").read_text())]), "n1's server survived"
    steps = local_slurm.run("squeue", "-h", "-s", "-j", job, check=False).stdout.strip()
    assert steps == "", f"steps of job {job} still listed: {steps}"


@pytest.mark.timeout(120)
def test_trainer_rank_failure_names_node_and_rank(local_slurm, tmp_path):
    out = _salloc(local_slurm, "--recipe", str(TEST_RECIPE_32B), "rollout.engine=hf", "rollout.weight_sync=copy",
                  "parallel.tp=2", "parallel.cp=1", "--log-dir", str(tmp_path / "logs"), "--trainer-cmd",
                  f"{PROBE} --out {tmp_path}/ranks --fail-rank 1 --code 7", gpus=False)  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "trainer (step dapo-trainer) failed on node n2, rank 1: Exited with exit code 7" in out.stderr, out.stderr
    assert f"log: {tmp_path}/logs/trainer-1.log" in out.stderr


@pytest.mark.timeout(240)
def test_cpu_ranks_allreduce_across_nodes(local_slurm, tmp_path):
    """rollout.engine=hf: no servers; one rank per node; a real gloo all_reduce through MASTER_ADDR/MASTER_PORT."""
    out = _salloc(local_slurm, "--recipe", str(TEST_RECIPE_32B), "rollout.engine=hf", "rollout.weight_sync=copy",
                  "parallel.tp=2", "parallel.cp=1", "--log-dir", str(tmp_path / "logs"), "--trainer-cmd",
                  f"{PROBE} --out {tmp_path}/ranks --allreduce", gpus=False, timeout=200)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    recs = read_ranks(tmp_path / "ranks")
    assert [(r["RANK"], r["node"]) for r in recs] == [("0", "n1"), ("1", "n2")]
    assert [r["allreduce"] for r in recs] == [1.0 + 2.0] * 2
    assert "rollout servers: 0" in out.stderr and "dapo-server" not in out.stderr


@pytest.mark.timeout(180)
def test_local_slurm_script_is_idempotent_and_down_stops_it():
    """A second cluster (own state dir and ports): up twice keeps the same daemons; down leaves nothing running."""
    state = Path(tempfile.mkdtemp(prefix="dapo-slurm-idem-"))
    base = str(free_port_base())
    sh = ["bash", str(SCRIPT)]
    try:
        first = subprocess.run([*sh, "up", "--state", str(state), "--port-base", base], capture_output=True,
                               text=True, timeout=120)  # fmt: skip
        assert first.returncode == 0, first.stderr
        pids = {p.stem: int(p.read_text()) for p in (state / "run").glob("*.pid")}
        assert sorted(pids) == ["munged", "slurmctld", "slurmd-n1", "slurmd-n2"]
        again = subprocess.run([*sh, "up", "--state", str(state), "--port-base", base], capture_output=True,
                               text=True, timeout=120)  # fmt: skip
        assert again.returncode == 0 and again.stdout == first.stdout
        assert {p.stem: int(p.read_text()) for p in (state / "run").glob("*.pid")} == pids
        other = subprocess.run([*sh, "up", "--state", str(state), "--port-base", str(int(base) + 1)],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert other.returncode != 0 and "run down first" in other.stderr
        status = subprocess.run([*sh, "status", "--state", str(state)], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and "idle" in status.stdout
    finally:
        down = subprocess.run([*sh, "down", "--state", str(state)], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not [n for n, p in pids.items() if process_running(p)]
    assert not list((state / "run").glob("*.pid"))
    assert subprocess.run([*sh, "down", "--state", str(state)], capture_output=True, timeout=60).returncode == 0
    status = subprocess.run([*sh, "status", "--state", str(state)], capture_output=True, text=True, timeout=60)
    assert status.returncode == 3 and "slurmctld: stopped" in status.stdout
    shutil.rmtree(state, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_tiny_cpu_sbatch_end_to_end(local_slurm, tmp_path):
    """slurm/dapo_tiny_cpu.sbatch as is: 2 training steps with TP=2 across the 2 nodes, then a checkpoint."""
    env_run = {"RUN_DIR": str(tmp_path / "runs")}
    job = local_slurm.submit(f"--output={tmp_path}/job.out", "--export=ALL," + ",".join(f"{k}={v}" for k, v in
                             env_run.items()), "slurm/dapo_tiny_cpu.sbatch")  # fmt: skip
    state, code, _ = local_slurm.wait(job, 1100)
    text = (tmp_path / "job.out").read_text()
    assert state == "COMPLETED", f"{state} {code}\n{text[-6000:]}"
    run = tmp_path / "runs" / f"tiny-cpu-{job}"
    logs = run / f"slurm-{job}"
    assert (logs / "trainer-0.log").is_file() and (logs / "trainer-1.log").is_file()
    # the two steps ran and were logged ...
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2], rows
    assert all(r["train/kept_groups"] > 0 and r["time/train_s"] > 0 for r in rows), rows
    # ... and the final checkpoint is complete: converted to HF on one process (both TP shards read), it equals the
    # HF model the run exported from the live actor, tensor for tensor
    ckpt = run / "checkpoints" / "step_000002"
    meta = json.loads((ckpt / "dapo_meta.json").read_text())
    assert (meta["step"], meta["tp"], meta["world_size"]) == (2, 2, 2), meta
    conv = subprocess.run([sys.executable, "tools/convert_megatron_to_hf.py", "--in", str(ckpt), "--out",
                           str(tmp_path / "hf"), "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert conv.returncode == 0, conv.stderr[-3000:]
    converted, exported = read_safetensors_dir(tmp_path / "hf"), read_safetensors_dir(run / "hf")
    assert converted.keys() == exported.keys() and len(converted) > 10
    assert all(torch.equal(converted[k], exported[k]) for k in converted)


def _nemo(local_slurm, tmp_path: Path, *args: str, timeout: float = 280) -> subprocess.CompletedProcess:
    env = {**local_slurm.env, "NEMORUN_HOME": str(tmp_path / "nemo")}
    cmd = [*DRIVER, "--nemo", "--recipe", str(TEST_RECIPE_32B), "--account", "test", "--partition", "debug",
           "--nodes", "2", "--gpus-per-node", "8", "--exclusive", "--ntasks-per-node", "1", *ONE_ENGINE_PER_NODE, "parallel.tp=2",
           "parallel.cp=1", "--log-dir", str(tmp_path / "logs"), *args]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _nemo_job_dir(tmp_path: Path) -> Path:
    (sbatch,) = (tmp_path / "nemo" / "experiments").glob("*/*/dapo_sbatch.sh")
    return sbatch.parent


@pytest.mark.timeout(300)
def test_nemo_run_slurm_executor(local_slurm, tmp_path):
    """`dapo launch --nemo`: nemo-run's SlurmExecutor + LocalTunnel submits the driver, which runs on the host in the
    packaged code (<job dir>/code), starts servers + trainer, and near the time limit (a 2-minute job, stop 110 s
    before it) stops the trainer, requeues the job and resumes it in the next allocation.
    `make test` installs nemo-run (the [launch] extra): missing, this test fails rather than skips."""
    import nemo_run  # noqa: F401

    port = free_port_pair()
    run = tmp_path / "runs" / "test-32b"
    trainer = (f"bash -c '{{python}} {HERE}/rank_probe.py --out {tmp_path}/ranks && "
               f"exec {{python}} {HERE}/stop_probe.py --run-dir {run} --wait-s 150 --resume {{resume}}'")  # fmt: skip
    out = _nemo(local_slurm, tmp_path, "--time", "00:02:00", "--stop-before", "110", f"cluster.server_port={port}",
                f"train.run_dir={tmp_path}/runs", "train.steps=2", "--server-cmd", FAKE_SERVER, "--trainer-cmd",
                trainer)  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "'dapo': 'SUCCEEDED'" in out.stderr
    recs = read_ranks(tmp_path / "ranks")
    assert [(r["RANK"], r["node"]) for r in recs] == [("0", "n1"), ("1", "n2")]
    assert all(set(r["servers"].values()) == {200} and len(r["servers"]) == 2 for r in recs)
    # packaged code: the driver imports it from <job dir>/code, the steps start there (python -m imports from cwd)
    job_dir = _nemo_job_dir(tmp_path) / "dapo"
    code = job_dir / "code"
    assert all(r["cwd"] == str(code) for r in recs)
    assert (code / "megatron_dapo" / "launch" / "slurm.py").read_bytes() == (
        REPO / "megatron_dapo" / "launch" / "slurm.py"
    ).read_bytes()
    logs = sorted(job_dir.glob("log-*.out"))
    driver = "\n".join(p.read_text() for p in logs)
    assert f"code: {code}/megatron_dapo (run from {code})" in driver
    # the time limit: the driver stops the trainer, which 'saves' step 1 of 2, and requeues the job
    assert len(logs) == 2 and "requeue job" in driver
    assert "stop requested (the time limit is " in driver and " s away (--stop-before 110))" in driver
    probes = [json.loads(line) for line in (run / "probe.log").read_text().splitlines()]
    assert sorted((p["restart"], p["rank"]) for p in probes) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert all(p["stop"].startswith("the time limit is ") and p["argv"] == ["--resume", "auto"] for p in probes)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]


@pytest.mark.timeout(200)
def test_nemo_run_driver_on_host_steps_in_container(local_slurm, tmp_path):
    """With --container-image: nemo-run's script starts the driver on the host (--chdir to the packaged code, no
    container flags); the driver's plan (printed by --driver-dry-run inside the allocation) runs the server and
    trainer steps in the image, with the packaged code mounted as their working directory. (pyxis itself is not
    installed here: the steps are planned, not started.)"""
    out = _nemo(local_slurm, tmp_path, "--container-image", "nvcr.io/acme/dapo:1", "--container-mounts",
                "/lustre:/lustre", "--driver-dry-run")  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    job_dir = _nemo_job_dir(tmp_path)
    code = job_dir / "dapo" / "code"
    (driver_srun,) = [line for line in (job_dir / "dapo_sbatch.sh").read_text().splitlines()
                      if line.startswith("srun ") and "megatron_dapo.launch.slurm" in line]  # fmt: skip
    assert f"--chdir {code}" in driver_srun and "--stop-before 900" in driver_srun
    assert "--container" not in driver_srun and "cluster.container_image=nvcr.io/acme/dapo:1" in driver_srun
    (log,) = (job_dir / "dapo").glob("log-*.out")
    text = log.read_text()
    plan = json.loads(text[text.index("{") : text.rindex("}") + 1])
    for step in [*plan["servers"], plan["trainer"]]:
        assert "--container-image=nvcr.io/acme/dapo:1" in step["srun"] and f"--container-workdir={code}" in step["srun"]
        assert f"--container-mounts=/lustre:/lustre,{code}:{code}" in step["srun"]
        assert step["command"][0] == "python"  # the image's interpreter
    assert os.path.isdir(tmp_path / "nemo" / "experiments")


@pytest.mark.timeout(60)
def test_local_slurm_script_refuses_clearly_without_root(tmp_path):
    """Not root: a clear message and exit 1, both when Slurm is missing (hidden from PATH) and when it is there.

    ``nobody`` runs a copy of the script in a world-readable folder: the checkout may live where only its owner can
    read (a clone under /root, or in a ``mktemp -d`` folder, mode 0700)."""
    if os.geteuid() != 0 or not shutil.which("runuser"):
        skip_unless_required("slurm", "needs root to run the script as another user (runuser)")
    public = Path(tempfile.mkdtemp(prefix="dapo-local-slurm-", dir="/tmp"))  # not $TMPDIR: it may be private too
    try:
        public.chmod(0o755)
        script = public / SCRIPT.name
        shutil.copy(SCRIPT, script)
        script.chmod(0o755)
        _refuses_without_root(script, tmp_path)
    finally:
        shutil.rmtree(public, ignore_errors=True)


def _refuses_without_root(script: Path, tmp_path: Path) -> None:
    base = ["runuser", "-u", "nobody", "--"]
    up = ["bash", str(script), "up", "--state", str(tmp_path / "s")]
    missing = subprocess.run(
        [*base, "env", "PATH=/usr/bin:/bin", *up], capture_output=True, text=True, timeout=30, cwd=script.parent
    )
    assert missing.returncode == 1 and "Slurm is not installed" in missing.stderr and "needs root" in missing.stderr
    assert "apt-get install" in missing.stderr
    present = subprocess.run([*base, *up], capture_output=True, text=True, timeout=30, cwd=script.parent)
    if shutil.which("slurmctld"):
        assert present.returncode == 1 and "must run as root" in present.stderr
    assert not (tmp_path / "s").exists()
