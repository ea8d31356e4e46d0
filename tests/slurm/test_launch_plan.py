"""The Slurm driver's plan and supervision, without a Slurm cluster (these run everywhere; see test_local_slurm.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dapo.config.run_config import load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.launch.slurm import (
    LaunchError,
    LaunchOptions,
    Supervisor,
    build_plan,
    expand_nodelist,
    parse_tasks_per_node,
    torch_env_from_slurm,
)
from tests.helpers import REPO, fake_allocation_srun
from tests.slurm.conftest import HERE, TEST_RECIPE_32B, free_port, process_running

R32 = str(TEST_RECIPE_32B)
# one TP8 engine on one node; a 32B trainer on 8 GPUs is predicted not to fit, which these tests do not run
ONE_NODE = ("parallel.cp=1", "rollout.sglang.tp=8", "cluster.memory_check=false")
NO_SLURM_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "NCCL_", "GLOO_"))}


def plan_for(*overrides: str, env: dict | None = None, **opts):
    return build_plan(LaunchOptions(recipe=R32, overrides=list(overrides), **opts), env=env or {}, dry_run=True)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("n[1-2]", ["n1", "n2"]),
        ("gpu[08-10,12],login", ["gpu08", "gpu09", "gpu10", "gpu12", "login"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a,b", ["a", "b"]),
        ("node007", ["node007"]),
    ],
)
def test_expand_nodelist(spec, expected):
    assert expand_nodelist(spec) == expected


@pytest.mark.parametrize("bad", ["n[1-", "n[a-b]"])
def test_expand_nodelist_rejects_bad_specs(bad):
    with pytest.raises(LaunchError, match="node list"):
        expand_nodelist(bad)


def test_parse_tasks_per_node():
    assert parse_tasks_per_node("8(x2),4") == [8, 8, 4]
    assert parse_tasks_per_node("1") == [1]
    with pytest.raises(LaunchError):
        parse_tasks_per_node("8x2")


def test_torch_env_from_slurm_maps_task_ids():
    env = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "4(x4)", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}  # fmt: skip
    out = torch_env_from_slurm(env)
    assert out == {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "NODE_RANK": "1",
                   "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}  # fmt: skip
    # without MASTER_*: the first node of the step, and the rendezvous port of the job's block
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "hostx,hosty", "SLURM_JOB_ID": "12345",
           "SLURM_CONF": "/nonexistent/slurm.conf"}  # fmt: skip
    out = torch_env_from_slurm(env)
    assert (out["MASTER_ADDR"], out["MASTER_PORT"], out["WORLD_SIZE"]) == ("hostx", "20000", "2")  # 10000 + 25 x 400
    assert torch_env_from_slurm({**env, "DAPO_PORT_BASE": "12000"})["MASTER_PORT"] == "12000"  # the launcher's block
    with pytest.raises(LaunchError, match="SLURM_PROCID"):
        torch_env_from_slurm({})
    # colocated servers: each rank learns the server on its own node (node rank = index in the trainer's node list)
    urls = ["http://a:1", "http://b:2"]
    env = {**env, "SLURM_NODEID": "1", "DAPO_SERVER_URLS": json.dumps(urls), "DAPO_PLACEMENT": "colocated"}
    assert torch_env_from_slurm(env)["DAPO_LOCAL_SERVER_URL"] == "http://b:2"
    assert "DAPO_LOCAL_SERVER_URL" not in torch_env_from_slurm({**env, "DAPO_PLACEMENT": "disaggregated"})


@pytest.mark.timeout(60)
def test_rank_exec_sets_env_and_execs(tmp_path):
    env = {**NO_SLURM_ENV, "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_TASKS_PER_NODE": "2(x2)", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4567"}  # fmt: skip
    code = "import os, json; print(json.dumps({k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', " \
           "'LOCAL_WORLD_SIZE', 'MASTER_PORT')}))"  # fmt: skip
    cmd = [sys.executable, "-m", "megatron_dapo.launch.slurm", "rank-exec", "--", sys.executable, "-c", code]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                      "MASTER_PORT": "4567"}  # fmt: skip


def test_colocated_plan_16_nodes():
    plan = plan_for("parallel.pp=2", nodes=16)
    assert plan.placement == "colocated" and plan.model == "qwen2.5-32b"
    assert plan.nodes == [f"node{i}" for i in range(1, 17)]
    assert (plan.gpus_per_node, plan.tasks_per_node, plan.world_size) == (8, 8, 128)
    assert (plan.tp, plan.pp, plan.cp, plan.dp) == (8, 2, 2, 128 // (8 * 2 * 2))
    assert plan.train_nodes == plan.rollout_nodes == plan.nodes
    # one SGLang server per rollout-TP group of GPUs: two TP4 engines per node, GPUs 0-3 and 4-7
    assert [s.nodes for s in plan.servers] == [[n] for n in plan.nodes for _ in range(2)]
    for i, s in enumerate(plan.servers):
        cmd = " ".join(s.command)
        base, port = (0, 10008) if i % 2 == 0 else (4, 10048)
        assert "-m sglang.launch_server --model-path /models/Qwen2.5-32B" in cmd
        assert "--tp-size 4" in cmd and "--dp-size" not in cmd and "--enable-memory-saver" in cmd  # SGLang: dp 1
        assert f"--base-gpu-id {base}" in cmd and s.engine["base_gpu_id"] == base
        assert s.engine["senders"] == list(range(i * 4, i * 4 + 4))  # the trainer ranks on the engine's GPUs
        # tempered logprobs (the engine's convention); the CUDA graphs released with the rest while the server sleeps
        assert "--export=ALL,SGLANG_RETURN_ORIGINAL_LOGPROB=0,SGLANG_MEMORY_SAVER_CUDA_GRAPH=1" in s.srun
        assert "--enable-deterministic-inference" in cmd  # else SGLang ignores sampling_seed
        assert f"--port {port}" in cmd and f"--nccl-port {port + 1}" in cmd and "--mem-fraction-static 0.6" in cmd
        # locked down: the node's address (dry run: its name), the key in a file, the output redacted by the wrapper
        assert f"--host {s.nodes[0]} " in cmd and "0.0.0.0" not in cmd and "api-key" not in cmd
        assert f"--config {plan.server_args_file}" in cmd and plan.server_args_file.endswith("/sglang-args.yaml")
        assert s.command[1:4] == ["-m", "megatron_dapo.engines.sglang.auth", s.command[0]]
        assert s.srun[:2] == ["srun", "--overlap"] and f"--nodelist={s.nodes[0]}" in s.srun
        assert s.name == f"dapo-server-{s.nodes[0]}-g{base}" and s.log.endswith(f"server-{s.nodes[0]}-g{base}.log")
    t = plan.trainer.srun
    assert "--nodes=16" in t and "--ntasks=128" in t and "--ntasks-per-node=8" in t and "--gpus-per-node=8" in t
    i = t.index("rank-exec")
    assert t[i + 1 : i + 2] == ["--"] and t[i + 3 : i + 8] == ["-m", "megatron_dapo.cli", "train", "--recipe", R32]
    # the trainer is told where the servers are, in a form the config parser reads back
    url_arg = [a for a in t if a.startswith("rollout.server_urls=")]
    cfg = load_config(R32, ["parallel.pp=2", url_arg[0]])
    assert cfg.rollout.server_urls == [s.url for s in plan.servers]
    assert [s.url for s in plan.servers] == [f"http://{n}:{p}" for n in plan.nodes for p in (10008, 10048)]
    assert plan.env["DAPO_ENGINES_PER_NODE"] == "2" and plan.layout["pp_spans_nodes"]
    assert plan.env["MASTER_ADDR"] == "node1" and plan.env["MASTER_PORT"] == "10000"  # dry run: block 0
    # the trainer's errors about a server (restart limit) name the launcher's log of that server
    assert json.loads(plan.env["DAPO_SERVER_LOGS"]) == {s.url: s.log for s in plan.servers}


def test_disaggregated_plan():
    plan = plan_for("cluster.placement=disaggregated", "cluster.rollout_nodes=4", "rollout.colocate=false",
                    "rollout.weight_sync=distributed", nodes=16)  # fmt: skip
    assert plan.train_nodes == [f"node{i}" for i in range(1, 13)]
    assert plan.rollout_nodes == [f"node{i}" for i in range(13, 17)]
    assert plan.world_size == 12 * 8 and plan.dp == 96 // (8 * 1 * 2)
    assert all("--enable-memory-saver" not in s.command for s in plan.servers)
    assert all("--export=ALL,SGLANG_RETURN_ORIGINAL_LOGPROB=0" in s.srun for s in plan.servers)  # no memory saver
    assert "--nodelist=" + ",".join(plan.train_nodes) in plan.trainer.srun


@pytest.mark.parametrize(
    "overrides, culprit",
    [
        (
            ["cluster.placement=disaggregated", "cluster.rollout_nodes=4", "rollout.colocate=false"],
            "rollout.weight_sync",
        ),
        (
            [
                "cluster.placement=disaggregated",
                "cluster.rollout_nodes=2",
                "rollout.colocate=false",
                "rollout.weight_sync=distributed",
            ],
            "cluster.rollout_nodes",
        ),  # fmt: skip
        (
            ["cluster.placement=disaggregated", "cluster.rollout_nodes=1", "rollout.weight_sync=distributed"],
            "rollout.colocate",
        ),
        (["parallel.tp=3"], "parallel.tp"),
        (["rollout.sglang.tp=3"], "rollout.sglang.tp"),
        (["model.hf_init=null"], "model.hf_init"),
    ],
)
def test_bad_layouts_name_the_key(overrides, culprit):
    with pytest.raises(ConfigError, match=culprit.replace(".", r"\.")):
        plan_for(*overrides, nodes=2)


def test_cpu_plan_has_no_servers():
    plan = plan_for("rollout.engine=hf", "rollout.weight_sync=copy", "parallel.tp=2", "parallel.cp=1", nodes=2)
    assert (plan.placement, plan.servers, plan.gpus_per_node, plan.world_size) == ("cpu", [], 0, 2)
    assert not any(a.startswith("--gpus") for a in plan.trainer.srun)
    assert not any(a.startswith("rollout.server_urls") for a in plan.trainer.command)
    plan = plan_for("rollout.engine=hf", "rollout.weight_sync=copy", "parallel.tp=2", "parallel.cp=1", nodes=2,
                    env={"SLURM_NTASKS_PER_NODE": "3"})  # fmt: skip
    assert plan.world_size == 6 and "--ntasks-per-node=3" in plan.trainer.srun


def test_external_servers_are_not_started():
    plan = plan_for('rollout.server_urls=["http://a:1"]', nodes=2)
    assert plan.servers == [] and plan.rollout_nodes == []
    assert sum(a.startswith("rollout.server_urls") for a in plan.trainer.command) == 1  # the user's, not a second one


def test_plan_inside_an_allocation():
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_GPUS_ON_NODE": "4",
           "SLURM_CPUS_ON_NODE": "64", "SLURM_CONF": "/nonexistent/slurm.conf"}  # fmt: skip
    small = ["parallel.tp=4", "parallel.cp=1", "cluster.memory_check=false"]  # 32B on 12 GPUs: predicted not to fit
    plan = build_plan(LaunchOptions(recipe=R32, overrides=small), env=env)
    assert plan.nodes == ["gpu01", "gpu02", "gpu03"] and plan.job_id == "4242"
    assert (plan.gpus_per_node, plan.world_size, plan.dp) == (4, 12, 3)
    assert plan.master_port == 10000 + 4242 % 55 * 400 and plan.master_addr == "gpu01"
    assert "--cpus-per-task=16" in plan.trainer.srun and "--cpus-per-task=64" in plan.servers[0].srun
    assert plan.log_dir == "runs/test-32b/slurm-4242"
    # the second allocation of a requeued job: its own logs and stop file
    requeued = build_plan(LaunchOptions(recipe=R32, overrides=small),
                          env={**env, "SLURM_RESTART_COUNT": "1"})  # fmt: skip
    assert requeued.log_dir == "runs/test-32b/slurm-4242-r1"
    assert requeued.env["DAPO_STOP_FILE"] == "runs/test-32b/slurm-4242-r1/stop-request"
    # sbatch's --gpus-per-node=h100:8 form, and a subset of the nodes
    env2 = {**env, "SLURM_GPUS_PER_NODE": "h100:8"}
    del env2["SLURM_GPUS_ON_NODE"]
    plan = build_plan(LaunchOptions(recipe=R32, nodes=2, overrides=["cluster.memory_check=false"]), env=env2)
    assert plan.nodes == ["gpu01", "gpu02"] and plan.gpus_per_node == 8
    with pytest.raises(LaunchError, match="only 3 nodes"):
        build_plan(LaunchOptions(recipe=R32, nodes=4, overrides=small), env=env)


def test_container_and_network_settings():
    plan = plan_for("cluster.container_image=nvcr.io/x/y:1", "cluster.container_mounts=[/a:/a,/b:/b]",
                    "cluster.nccl_socket_ifname=ib0", "cluster.ib_hca=mlx5", nodes=2)  # fmt: skip
    for step in [*plan.servers, plan.trainer]:
        here = os.getcwd()  # the code the steps run (the packaged copy under nemo-run) is mounted where it is
        assert "--container-image=nvcr.io/x/y:1" in step.srun and f"--container-workdir={here}" in step.srun
        assert f"--container-mounts=/a:/a,/b:/b,{here}:{here}" in step.srun
        assert step.command[0] == "python"  # the container's interpreter, not this venv's
    # the GPU stack's preflight runs in the image too, one task on the first node, before any server step
    assert plan.preflight[:2] == ["srun", "--overlap"] and plan.preflight[-1] == "python"
    assert "--container-image=nvcr.io/x/y:1" in plan.preflight and "--nodelist=node1" in plan.preflight
    assert "[dapo-preflight] srun --overlap" in plan.describe() and plan_for(nodes=2).preflight == []
    assert plan.env["NCCL_SOCKET_IFNAME"] == plan.env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert plan.env["NCCL_IB_HCA"] == "mlx5"
    assert plan_for(nodes=2, env={"NCCL_IB_HCA": "mlx5_0"}).env["NCCL_IB_HCA"] == "mlx5_0"  # inherited


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_dapo.launch.slurm", *args]
    return subprocess.run(cmd, env=NO_SLURM_ENV, capture_output=True, text=True, cwd=REPO, timeout=60)


@pytest.mark.timeout(120)
def test_dry_run_cli_outside_slurm():
    out = _cli("--recipe", R32, "--dry-run", "--nodes", "16", "parallel.pp=2")
    assert out.returncode == 0, out.stderr
    assert "model qwen2.5-32b" in out.stdout and "TP=8 PP=2 CP=2 DP=4" in out.stdout
    assert out.stdout.count("-m sglang.launch_server") == 32
    assert "--ntasks=128" in out.stdout
    js = json.loads(_cli("--recipe", R32, "--dry-run", "--json", "--nodes", "2").stdout)
    assert js["roles"] == {"node1": ["train", "rollout"], "node2": ["train", "rollout"]}
    # not dry: needs an allocation; bad input names the culprit
    out = _cli("--recipe", R32)
    assert out.returncode == 2 and "not inside a Slurm allocation" in out.stderr
    out = _cli("--recipe", R32, "--dry-run", "parallel.tpp=2")
    assert out.returncode == 2 and "parallel.tpp" in out.stderr


@pytest.mark.timeout(120)
def test_dry_run_never_shows_the_api_key():
    key = "dry-run-key-must-not-show-4f1c"
    env = {**NO_SLURM_ENV, "DAPO_SGLANG_API_KEY": key}
    for extra in ([], ["--json"]):
        cmd = [sys.executable, "-m", "megatron_dapo.launch.slurm", "--recipe", R32, "--dry-run", "--nodes", "2", *extra]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "sglang-args.yaml" in out.stdout and key not in out.stdout + out.stderr


@pytest.mark.timeout(60)
def test_supervisor_fails_fast_and_tears_down(tmp_path, python):
    """Real processes in place of srun steps: a server that dies stops everything at once, and names its node."""
    port = free_port()
    pids = tmp_path / "pids"
    server = f"{{python}} {HERE}/fake_sglang_server.py --port {{port}} --node {{node}} --pid-dir {pids}"
    plan = plan_for(*ONE_NODE, f"cluster.server_port={port}", nodes=1, log_dir=str(tmp_path / "logs"),
                    server_cmd=server + " --fail-on node1 --fail-after 1.5", trainer_cmd="{python} -c pass")  # fmt: skip
    plan.health_timeout_s = 30
    for step in plan.servers:  # no srun here: run the step's program directly, reach it on loopback
        step.srun, step.url = step.command, f"http://127.0.0.1:{port}"
    plan.trainer.srun = [python, "-c", "import time; time.sleep(60)"]
    t0 = time.monotonic()
    lines: list[str] = []

    class Out:
        def write(self, s):
            lines.append(s)

        def flush(self):
            pass

    rc = Supervisor(plan, poll_s=0.1, out=Out()).run()
    text = "".join(lines)
    assert rc == 1 and time.monotonic() - t0 < 20
    assert "rollout server on node node1 (step dapo-server-node1) exited with code 1" in text
    assert f"{plan.log_dir}/server-node1.log" in text
    assert "stopping dapo-trainer" in text
    assert json.loads(Path(plan.log_dir, "plan.json").read_text())["servers"][0]["name"] == "dapo-server-node1"


@pytest.mark.timeout(60)
def test_supervisor_success_stops_servers(tmp_path, python):
    """The server runs behind the real wrapper (engines/sglang/auth.py) and prints the key as SGLang does: the key's
    value must be in no log, no command line and no environment of the server; SIGTERM reaches it through the wrapper.
    """
    port = free_port()
    pids = tmp_path / "pids"
    server = (f"{{python}} -m megatron_dapo.engines.sglang.auth {{python}} {HERE}/fake_sglang_server.py --port {{port}} "
              f"--node {{node}} --pid-dir {pids} --config {{args_file}}")  # fmt: skip
    plan = plan_for(
        *ONE_NODE, f"cluster.server_port={port}", nodes=1, log_dir=str(tmp_path / "logs"), server_cmd=server
    )
    plan.servers[0].srun, plan.servers[0].url = plan.servers[0].command, f"http://127.0.0.1:{port}"
    # the trainer: the servers answer; the job's key is in its environment and, alone, in the 0600 args file
    probe = (f"import os, stat, yaml, urllib.request as u; assert u.build_opener(u.ProxyHandler({{}})).open("
             f"'{plan.servers[0].url}/health').status == 200; key = os.environ['DAPO_SGLANG_API_KEY']; "
             f"f = '{plan.server_args_file}'; assert stat.S_IMODE(os.stat(f).st_mode) == 0o600; "
             f"assert yaml.safe_load(open(f)) == {{'api-key': key, 'admin-api-key': key}}; "
             f"pid = open('{pids}/server-node1.pid').read().strip(); "
             f"assert key.encode() not in open(f'/proc/{{pid}}/environ', 'rb').read(), 'key in the server env'; "
             f"assert key.encode() not in open(f'/proc/{{pid}}/cmdline', 'rb').read(), 'key on its command line'; "
             f"open('{tmp_path}/key', 'w').write(key)")  # fmt: skip
    plan.trainer.srun = [python, "-c", probe]
    assert Supervisor(plan, poll_s=0.1).run() == 0
    key = (tmp_path / "key").read_text()
    assert len(key) >= 32 and not Path(plan.server_args_file).exists(), "the key file outlived the job"
    server_log = Path(plan.log_dir, f"{plan.servers[0].name}.srun.log").read_text()  # no srun: its output is here
    assert "'api_key': '<redacted>'" in server_log, "the server printed its server_args: the wrapper redacts them"
    for f in Path(plan.log_dir).iterdir():
        assert key not in f.read_text(errors="replace"), f"the key is in {f}"
    pid = int((pids / "server-node1.pid").read_text())
    deadline = time.monotonic() + 10
    while process_running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_running(pid), "the server was not stopped after the trainer finished"


@pytest.mark.timeout(60)
def test_nemo_without_nemo_run_says_how_to_install():
    # nemo-run hidden from the import system (sys.modules[name] = None makes `import nemo_run` raise ImportError),
    # so this runs where the extra is installed too
    hide = "import sys; sys.modules['nemo_run'] = None; from megatron_dapo.launch.slurm import main; sys.exit(main())"
    cmd = [sys.executable, "-c", hide, "--nemo", "--recipe", R32, "--account", "a"]
    out = subprocess.run(cmd, env=NO_SLURM_ENV, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2 and "pip install 'megatron-dapo[launch]'" in out.stderr


@pytest.mark.timeout(240)
def test_nemo_local_executor_runs_ranks(tmp_path):
    """`dapo launch --nemo --executor local`: nemo-run's LocalExecutor runs 2 ranks under torch.distributed.run.
    `make test` installs nemo-run (the [launch] extra): missing, this test fails rather than skips."""
    import nemo_run  # noqa: F401

    env = {**NO_SLURM_ENV, "NEMORUN_HOME": str(tmp_path / "nemo")}
    cmd = [sys.executable, "-m", "megatron_dapo.launch.slurm", "--nemo", "--executor", "local", "--recipe", R32,
           "--ntasks-per-node", "2", "--trainer-cmd", f"{{python}} {HERE}/rank_probe.py --out {tmp_path}/ranks"]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=220)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    recs = sorted(
        (json.loads(p.read_text()) for p in (tmp_path / "ranks").glob("rank-*.json")), key=lambda r: r["RANK"]
    )
    assert [(r["RANK"], r["WORLD_SIZE"], r["LOCAL_RANK"]) for r in recs] == [("0", "2", "0"), ("1", "2", "1")]


@pytest.mark.timeout(60)
def test_supervisor_names_the_rank_that_failed_first(tmp_path):
    """srun reports the failing rank and the ranks it then killed, in either order: name the one that exited."""
    plan = plan_for("rollout.engine=hf", "rollout.weight_sync=copy", "parallel.tp=2", "parallel.cp=1", nodes=2,
                    log_dir=str(tmp_path / "logs"))  # fmt: skip
    srun_says = "srun: error: node1: task 0: Terminated\nsrun: error: node2: task 1: Exited with exit code 7\n"
    plan.trainer.srun = ["bash", "-c", f"printf '{srun_says}'; exit 143"]
    lines: list[str] = []
    sup = Supervisor(plan, poll_s=0.05)
    sup.say = lines.append
    assert sup.run() == 1
    text = "\n".join(lines)
    assert "failed on node node2, rank 1: Exited with exit code 7 (srun exit code 143)" in text
    assert f"log: {tmp_path}/logs/trainer-1.log" in text


QWEN32B_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
                  "intermediate_size": 27648, "num_attention_heads": 40, "num_key_value_heads": 8,
                  "num_hidden_layers": 64, "vocab_size": 152064, "max_position_embeddings": 131072,
                  "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False}  # fmt: skip


@pytest.mark.timeout(120)
def test_dapo_32b_dry_run_shows_engines_sync_plan_and_phase_memory(tmp_path):
    """Issue 14: `dapo launch --recipe dapo_32b --dry-run --nodes 16 model.hf_init=DIR` shows dp=1 engines with their
    base GPU, the trainer ranks on their GPUs, the per-node sync plan with the PP exchange, and both phases < 80 GiB."""
    hf = tmp_path / "Qwen2.5-32B"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(QWEN32B_CONFIG))
    out = _cli("--recipe", "dapo_32b", "--dry-run", "--nodes", "16", f"model.hf_init={hf}")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "rollout engines: 32 SGLang servers, TP4 dp 1" in text and "2 per node" in text
    assert text.count("-m sglang.launch_server") == 32 and "--dp-size" not in text
    assert "engine   0  node1        GPUs 0-3 (--base-gpu-id 0, --tp-size 4)  port 10008  shares its GPUs with " \
           "trainer ranks 0-3 (DP [0], PP stage [0])" in text  # fmt: skip
    assert "engine  31  node16       GPUs 4-7 (--base-gpu-id 4, --tp-size 4)  port 10048  shares its GPUs with " \
           "trainer ranks 124-127 (DP [7], PP stage [1])" in text  # fmt: skip
    assert "  node9: engine 16 <- ranks 64-67 (rank 64 posts); engine 17 <- ranks 68-71 (rank 68 posts)" in text
    assert "PP exchange first: PP2 stages sit on different nodes" in text
    js = json.loads(_cli("--recipe", "dapo_32b", "--dry-run", "--json", "--nodes", "16", f"model.hf_init={hf}").stdout)
    for route in js["layout"]["routes"]:  # every engine is fed only by ranks of its own node
        assert {r // 8 for r in route["senders"]} == {route["node"]} and route["transport"] == "cuda_ipc"
    assert [s["engine"]["base_gpu_id"] for s in js["servers"]] == [0, 4] * 16
    phases = js["memory"]["phases"]
    assert set(phases) == {"rollout", "train", "startup"} and js["memory"]["fits"]
    assert all(ph["peak_gib"] < 80 * 0.95 for ph in phases.values()), phases
    rollout = phases["rollout"]["terms_gib"]
    assert rollout["trainer grads"] == rollout["trainer optimizer"] == 0  # offloaded to the host for the rollout
    # mem_fraction 0.60 × the memory free at the server's start: an 80 GB H100's 79.65 GiB less its CUDA context
    assert 47 < rollout["SGLang weights"] + rollout["SGLang KV cache"] < 48
    startup = phases["startup"]["terms_gib"]  # before the first release: the trainer's whole state beside SGLang's
    assert startup["trainer grads"] > 7 and startup["trainer optimizer"] > 2
    assert startup["SGLang CUDA graphs"] == 1.0  # SGLang's own estimate: 2 MB × cuda_graph_max_bs 512
    assert phases["train"]["terms_gib"]["SGLang (released)"] == 2.0
    for phase, peak in ((name, phases[name]["peak_gib"]) for name in ("rollout", "train", "startup")):
        assert f"  {phase} phase: " in text and f"= {peak:.1f} GiB: fits" in text


# By hand (tests/unit/test_plan.py QWEN32B_HAND): the trainer's stage-0 share at TP8 PP2 is 2,048,356,352 parameters,
# the whole model 32,763,876,352; GiB = 2**30.
_TRAINER_W = 2_048_356_352 * 2 / 2**30  # bf16: 3.82
_TRAINER_G = 2_048_356_352 * 4 / 2**30  # fp32 main grads: 7.63
_TRAINER_OPT = 2_048_356_352 * 12 / 8 / 2**30  # fp32 master + 2 Adam moments over DP 8: 2.86
_SGLANG_W = 32_763_876_352 * 2 / 4 / 2**30  # bf16 over rollout TP4: 15.26
# rollout phase at mem_fraction 0.9: SGLang's 0.9 × (79.65 − 0.5 GiB free at its start) holds its weights, the rest is
# KV cache; 79.65 GiB × 0.95 usable
_FREE_AT_START = 79.65 - 0.5
_ROLLOUT_REFUSAL = (f"rollout phase: peak 96.3 GiB > 75.7 GiB usable (SGLang KV cache "
                    f"{0.9 * _FREE_AT_START - _SGLANG_W:.1f}, SGLang weights {_SGLANG_W:.1f}, SGLang activations 12.0 GiB)")  # fmt: skip


@pytest.mark.parametrize(
    "override, phase",
    [("rollout.mem_fraction=0.9", _ROLLOUT_REFUSAL), ("parallel.max_tokens_per_micro_batch=45056", "train phase")],
)
def test_layout_predicted_not_to_fit_is_refused_before_any_step(override, phase, tmp_path):
    import re

    with pytest.raises(LaunchError, match="predicted not to fit") as err:
        plan_for("parallel.pp=2", "parallel.cp=1", override, "cluster.memory_check=true", nodes=16)
    assert phase in str(err.value) and "cluster.memory_check=false" in str(err.value)
    if phase == "train phase":  # the parameter terms by hand; the activations (the memory model's) fill the rest
        m = re.search(r"train phase: peak ([\d.]+) GiB > 75\.7 GiB usable \(trainer activations ([\d.]+), trainer "
                      r"grads ([\d.]+), overhead 5\.0 GiB\)", str(err.value))  # fmt: skip
        assert m, str(err.value)
        peak, act, grads = map(float, m.groups())
        assert grads == round(_TRAINER_G, 1)
        assert peak == pytest.approx(_TRAINER_W + _TRAINER_G + _TRAINER_OPT + act + 2.0 + 5.0, abs=0.15)
        assert peak > 75.7
    plan = plan_for("parallel.pp=2", "parallel.cp=1", override, "cluster.memory_check=false", nodes=16)
    assert not plan.memory["fits"] and len(plan.servers) == 32
    out = _cli("--recipe", R32, "--dry-run", "--nodes", "16", "parallel.pp=2", "parallel.cp=1", override,
               "cluster.memory_check=true")  # fmt: skip
    assert out.returncode == 2 and phase in out.stderr and out.stdout == ""


def test_each_rank_learns_the_engine_on_its_own_gpus():
    urls = [f"http://n{n}:{p}" for n in (1, 2) for p in (1, 2)]
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_TASKS_PER_NODE": "8(x2)", "MASTER_ADDR": "n1",
           "MASTER_PORT": "1", "DAPO_SERVER_URLS": json.dumps(urls), "DAPO_PLACEMENT": "colocated",
           "DAPO_ENGINES_PER_NODE": "2"}  # fmt: skip
    seen = [torch_env_from_slurm({**env, "SLURM_NODEID": str(r // 8), "SLURM_LOCALID": str(r % 8)})
            for r in range(16)]  # fmt: skip
    assert [s["DAPO_LOCAL_SERVER_URL"] for s in seen] == [u for u in urls for _ in range(4)]
    # the first rank of each engine's four posts its weights (placement.SyncRoute.poster): ranks 0, 4, 8, 12
    assert [r for r, s in enumerate(seen) if s["DAPO_LOCAL_SERVER_POSTER"] == "1"] == [0, 4, 8, 12]


@pytest.mark.parametrize(
    "override, culprit, because",
    [
        # issue 22 #3: a data-parallel server fails every weight update (SGLang asserts dp_size == 1); the quoted and
        # the bare form (once refused as "expected a string") alike
        ('rollout.sglang.args=[--dp-size, "2"]', "rollout.sglang.args", "asserts dp_size == 1"),
        ("rollout.sglang.args=[--dp-size, 2]", "rollout.sglang.args", "asserts dp_size == 1"),
        # issue 22 #2: colocated servers share the trainer's GPUs: one NCCL group, two ranks on one device
        ("rollout.weight_sync=distributed", "rollout.weight_sync", "NCCL refuses two ranks"),
    ],
)
def test_a_launch_the_servers_cannot_serve_is_refused_before_any_job_step(override, culprit, because, tmp_path,
                                                                          monkeypatch, capsys):  # fmt: skip
    from megatron_dapo.launch.slurm import main

    calls = fake_allocation_srun(tmp_path, monkeypatch)
    rc = main(["--recipe", R32, "--log-dir", str(tmp_path / "logs"), "--health-timeout", "1", *ONE_NODE, override])
    err = capsys.readouterr().err
    assert rc == 2 and f"{culprit} = " in err and because in err, err
    assert not calls.exists(), calls.read_text()  # no srun: no server step, no trainer step
