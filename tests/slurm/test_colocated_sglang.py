"""Issue 14 on the local Slurm: a colocated DAPO job on 2 emulated nodes with REAL SGLang 0.5.23 CPU engines.

`dapo launch` starts one SGLang server per node (one CPU "GPU" per node, rollout TP 1: two per node would double the
start-up on a 2-core CI machine) and 2 x 2 trainer ranks (TP 2 inside each node, DP 2 across the nodes). Observed at
the servers' own logs over 2 DAPO steps (the step's pattern twice): per step generate -> release -> resume -> sync,
and each engine is updated by the posting rank of its own node only (rank 0 on n1, rank 2 on n2), both exporting the
whole model through their TP group: read from each server's access log, where every weight-sync request names its
sender (``?poster=rank<RANK>.<node>``, from the posting process's own RANK and SLURMD_NODENAME), not from the
trainer's report of its routes. (That rank 0 waits out a rollout longer than the default group's collective timeout on the control plane is
shown by tests/dist/test_control_plane.py.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.helpers import REPO
from tests.slurm.test_local_slurm import DRIVER

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SMALL = ["train.supervised_warmup_steps=0", "algo.dynamic_sampling=false", "train.batch_prompts=8",
         "train.mini_batch_prompts=4", "algo.gen_batch_prompts=8", "algo.group_size=4", "eval.interval=0",
         "train.save_interval=0", "train.export_hf=false"]  # fmt: skip
EVENTS = {"/generate": "generate", "/release_memory_occupation": "release", "/resume_memory_occupation": "resume",
          "/update_weights_from_tensor": "sync"}  # fmt: skip


def _hf_init(out: Path) -> None:
    """The demo model's initial weights + its char tokenizer as an HF directory (what a user's model.hf_init is)."""
    code = (
        "import sys; from megatron_dapo.actor.actor import MegatronActor; from megatron_dapo.config.run_config import "
        "load_config; from megatron_dapo.bridge.export import save_hf_checkpoint; from megatron_dapo.data.tokenizer "
        "import load_tokenizer; cfg = load_config('demo_cpu', []); a = MegatronActor(cfg); "
        "save_hf_checkpoint(a.model, a.arch, sys.argv[1], load_tokenizer(None))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _events(log: str) -> list[str]:
    events = []
    for m in re.finditer(r'"POST (/\w+)(?:\?\S*)? HTTP/1.1" (\d+)', log):
        if m.group(1) in EVENTS:
            assert m.group(2) == "200", m.group(0)
            if not events or events[-1] != EVENTS[m.group(1)]:
                events.append(EVENTS[m.group(1)])
    return events


@pytest.mark.timeout(900)
def test_colocated_job_two_nodes_real_engines_per_node_sync(local_slurm, tmp_path, monkeypatch):
    # a user's own PYTHONPATH in the environment: the servers' (rollout.sglang.pythonpath) must still reach them
    env = dict(local_slurm.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    monkeypatch.setattr(local_slurm, "env", env)
    hf = tmp_path / "hf_init"
    _hf_init(hf)
    logs, runs = tmp_path / "logs", tmp_path / "runs"
    args = ["--recipe", "demo_cpu_sglang", *SMALL, "train.steps=2", f"train.run_dir={runs}", "train.name=colo",
            f"model.hf_init={hf}", "cluster.placement=colocated", "rollout.colocate=true", "rollout.sglang.tp=1",
            "parallel.tp=2", "--gpus-per-node", "1", "--ntasks-per-node", "2", "--log-dir", str(logs)]  # fmt: skip
    alloc = ["salloc", "-N2", "--exclusive", "--ntasks-per-node=2", "--gpus-per-node=1"]
    out = local_slurm.run(*alloc, *DRIVER, *args, timeout=840, check=False)
    trainer0 = (logs / "trainer-0.log").read_text() if (logs / "trainer-0.log").exists() else ""
    assert out.returncode == 0, out.stderr[-4000:] + trainer0[-4000:]

    plan = json.loads((logs / "plan.json").read_text())
    servers = {s["url"]: s["engine"] for s in plan["servers"]}
    assert [e["node"] for e in servers.values()] == ["n1", "n2"]
    assert [e["senders"] for e in servers.values()] == [[0, 1], [2, 3]]
    rows = [json.loads(line) for line in (runs / "colo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["sync/engines"] == 2 for r in rows)
    assert all(r["train/kept_groups"] == 8 for r in rows)

    # every sync (the initial one, then one per step): each engine from the posting rank of its own node
    syncs = re.findall(r"weight sync v(\d+) per node: (.*)", trainer0)
    assert [int(v) for v, _ in syncs] == [0, 1, 2], trainer0[-3000:]
    for _, routes in syncs:
        seen = dict(re.findall(r"(http://\S+) <- rank \d+ \((\w+)\)", routes))
        assert seen == {url: e["node"] for url, e in servers.items()}, routes
        assert sorted(map(int, re.findall(r"<- rank (\d+)", routes))) == [0, 2]

    # at each real server: its own log, in order; every update from its own node's poster (the first of its senders)
    for url, e in servers.items():
        text = Path(plan_log(plan, url)).read_text()
        check_senders(text, e["node"], e["senders"][0], syncs=3)
        events = _events(text)
        first = events.index("sync")
        # the phases of 0e6b9f7 (issue 22): the engine starts released; the initial sync, then its KV cache resumed
        # for the rollout; per step generate -> release -> (train) -> resume (weights) -> sync -> resume (KV cache);
        # the final eval generates
        step = ["generate", "release", "resume", "sync", "resume"]
        assert events[first:] == ["sync", "resume"] + step * 2 + ["generate"], events
        assert set(events[:first]) <= {"generate", "release"}, events  # the server's own warm-up, the first release
        assert text.count("POST /begin_weight_update") == text.count("POST /end_weight_update") == 3


def posters(log: str) -> dict[str, list[str]]:
    """Weight-sync endpoint -> the senders the server's access log names (``?poster=``), in order."""
    out: dict[str, list[str]] = {}
    for path, query in re.findall(r'"POST (/\w+)\?(\S*) HTTP/1.1" 200', log):
        tags = [unquote(v) for k, v in (kv.split("=", 1) for kv in query.split("&") if "=" in kv) if k == "poster"]
        out.setdefault(path, []).extend(tags)
    return out


def check_senders(log: str, node: str, rank: int, syncs: int) -> None:
    """Every weight update this server took came from ``rank`` on ``node`` (its own node's poster), ``syncs`` times."""
    got = posters(log)
    assert got.get("/update_weights_from_tensor"), f"no weight update reached the server on {node}"
    for path in ("/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"):
        assert set(got.get(path, [])) == {f"rank{rank}.{node}"}, (node, path, got)
    assert len(got["/begin_weight_update"]) == len(got["/end_weight_update"]) == syncs, got


def plan_log(plan: dict, url: str) -> str:
    (log,) = [s["log"] for s in plan["servers"] if s["url"] == url]
    return log


def test_sender_check_fails_for_a_poster_on_another_node():
    """The check above, on access-log lines as SGLang 0.5.23's uvicorn writes them: the right poster passes; rank 2
    of n2 posting to n1's engine, or an update that names no sender, fails."""

    def log(tag: str | None) -> str:
        q = f"?poster={tag}" if tag else ""
        return "\n".join(f'[t] INFO:     127.0.0.1:4{i}012 - "POST {p}{q} HTTP/1.1" 200 OK'
                         for i, p in enumerate(["/begin_weight_update", "/update_weights_from_tensor",
                                                "/end_weight_update"]))  # fmt: skip

    check_senders(log("rank0.n1"), "n1", 0, syncs=1)
    for wrong in ("rank2.n2", "rank0.n2", None):
        with pytest.raises(AssertionError):
            check_senders(log(wrong), "n1", 0, syncs=1)
    with pytest.raises(AssertionError):
        check_senders(log("rank0.n1"), "n1", 0, syncs=2)
