"""Execution of a launch plan (``slurm.build_plan``): start the server steps, wait for their health, start the
trainer, supervise, tear everything down on the first failure or signal."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_dapo.engines.registry import engine_spec
from megatron_dapo.launch.health import progress
from megatron_dapo.launch.slurm_env import LaunchError
from megatron_dapo.launch.stop import StopRelay

if TYPE_CHECKING:
    from megatron_dapo.launch.slurm import LaunchPlan, Step


def http_ok(url: str, timeout: float = 30.0, key: str = "") -> bool:
    """GET ``url`` answers 200 within ``timeout`` (SGLang's /health runs a 1-token generation: seconds when busy);
    with the job's ``key`` as every client call (SGLang leaves /health open, other servers may not)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # cluster proxies must not see node URLs
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with opener.open(req, timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, ValueError):
        return False


def _tail(path: str, n: int = 20) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return f"    ({path}: not written)"
    return "\n".join("    " + line for line in lines) or f"    ({path}: empty)"


class _Terminated(Exception):
    pass


class Supervisor:
    """Runs a plan's steps as child srun processes; any failure tears every other step down at once."""

    def __init__(
        self,
        plan: LaunchPlan,
        poll_s: float = 0.5,
        grace_s: float = 10.0,
        out=None,
        report_s: float = 30,
        stop_before_s: float = 0,
    ):
        self.plan, self.poll_s, self.grace_s, self.report_s = plan, poll_s, grace_s, report_s
        self.out = out or sys.stderr
        self.procs: list[tuple[Step, subprocess.Popen, str]] = []
        self.stop = StopRelay.for_plan(plan, lambda msg: self.say(msg), stop_before_s)
        self.api_key = ""  # the job's server key (run() makes it): in the trainer's environment only

    def _auth(self):
        """The servers' per-job key module (engines/registry.py ``auth_module``: SGLang's is engines/sglang/auth.py)."""
        return engine_spec(self.plan.engine).auth()

    def say(self, msg: str) -> None:
        print(f"[dapo launch {time.strftime('%H:%M:%S')}] {msg}", file=self.out, flush=True)

    def start(self, step: Step) -> None:
        srun_log = f"{self.plan.log_dir}/{step.name}.srun.log"
        key_env = self._auth().API_KEY_ENV if self.plan.servers else None
        env = {k: v for k, v in os.environ.items() if k != key_env} | self.plan.env | step.env
        if step.role == "trainer" and self.api_key:
            env[key_env] = self.api_key  # servers read theirs from the args file
        with open(srun_log, "w") as f:
            proc = subprocess.Popen(
                step.srun, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        self.procs.append((step, proc, srun_log))
        self.say(f"started {step.name} on {','.join(step.nodes)} (pid {proc.pid}); log {step.log}")

    def check(self) -> int | None:
        """Raise LaunchError if a step failed (or any server stopped); return the trainer's code when it ended."""
        for step, proc, srun_log in self.procs:
            rc = proc.poll()
            if rc is None or (step.role == "trainer" and rc == 0):
                continue
            if step.role == "rollout":
                raise LaunchError(
                    f"rollout server on node {step.nodes[0]} (step {step.name}) exited with code {rc}"
                    f"; log: {step.log}\n{_tail(step.log)}\n  srun: {srun_log}\n{_tail(srun_log, 5)}"
                )
            # "srun: error: n2: task 1: Exited with exit code 7"; the ranks srun then killed read "Terminated"
            found = re.findall(
                r"srun: error: (\S+): tasks? ([\d,-]+): (.*)", Path(srun_log).read_text(errors="replace")
            )
            found.sort(key=lambda f: "Exited with exit code" not in f[2])
            node, ranks, why = found[0] if found else (",".join(step.nodes), "0", f"srun exited with code {rc}")
            rank_log = step.log.replace("%t", re.split(r"[,-]", ranks)[0])
            raise LaunchError(
                f"trainer (step {step.name}) failed on node {node}, rank {ranks}: {why} (srun exit "
                f"code {rc}); log: {rank_log}\n{_tail(rank_log)}\n  srun: {srun_log}\n"
                f"{_tail(srun_log, 5)}"
            )
        done = [proc.returncode for step, proc, _ in self.procs if step.role == "trainer" and proc.returncode == 0]
        return 0 if done else None

    def wait_healthy(self) -> None:
        pending = {s.url for s in self.plan.servers}
        start = time.monotonic()
        deadline, report = start + self.plan.health_timeout_s, start + self.report_s
        while pending:
            self.check()
            self.stop.poll()
            if time.monotonic() > report:
                report += self.report_s
                waiting = [s for s in self.plan.servers if s.url in pending]
                self.say(
                    progress(waiting, len(self.plan.servers), time.monotonic() - start, self.plan.health_timeout_s)
                )
            for url in sorted(pending):
                if http_ok(url + "/health", key=self.api_key):
                    pending.discard(url)
                    self.say(f"server {url} is healthy")
            if pending and time.monotonic() > deadline:
                names = [s.name for s in self.plan.servers if s.url in pending]
                logs = [s.log for s in self.plan.servers if s.url in pending]
                raise LaunchError(
                    f"servers not healthy after {self.plan.health_timeout_s:.0f} s: {', '.join(names)} "
                    f"({', '.join(sorted(pending))}); logs: {', '.join(logs)}"
                )
            time.sleep(self.poll_s if pending else 0)

    def teardown(self) -> None:
        live = [(s, p) for s, p, _ in self.procs if p.poll() is None]
        for step, proc in live:
            self.say(f"stopping {step.name} (pid {proc.pid})")
            proc.send_signal(signal.SIGTERM)  # srun forwards it to the step's tasks
        deadline, killed = time.monotonic() + self.grace_s, set()
        for step, proc in live:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{step.name} did not stop within {self.grace_s:.0f} s: SIGKILL to its srun")
                proc.kill()
                proc.wait()
                killed.add(step.name)
        if killed and self.plan.job_id:
            self._scancel_leftovers(killed)

    def _scancel_leftovers(self, names: set[str]) -> None:
        """Cancel steps of OUR job, with OUR step names, that outlived their srun (only after a SIGKILL)."""
        try:
            out = subprocess.run(
                ["squeue", "-h", "-s", "-j", str(self.plan.job_id), "-o", "%i %j"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return
        for line in out.splitlines():
            step_id, _, name = line.strip().partition(" ")
            if name in names and step_id.startswith(f"{self.plan.job_id}."):
                self.say(f"scancel {step_id} ({name})")
                subprocess.run(["scancel", step_id], capture_output=True, timeout=10)

    def run(self) -> int:
        Path(self.plan.log_dir).mkdir(parents=True, exist_ok=True)
        Path(self.plan.log_dir, "plan.json").write_text(json.dumps(self.plan.as_dict(), indent=1))

        def on_signal(signum, _frame):
            raise _Terminated(signal.Signals(signum).name)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        old[signal.SIGUSR1] = self.stop.install()
        try:
            if self.plan.servers:
                auth = self._auth()
                self.api_key = os.environ.get(auth.API_KEY_ENV) or auth.new_api_key()
                auth.write_args_file(self.plan.server_args_file, self.api_key)
            for step in self.plan.servers:
                self.start(step)
            if self.plan.servers:
                self.wait_healthy()
            self.start(self.plan.trainer)
            while self.check() is None:
                self.stop.poll()
                time.sleep(self.poll_s)
            self.say(f"trainer finished; logs in {self.plan.log_dir}")
            return self.stop.exit_code()
        except LaunchError as e:
            self.say(f"FAILED: {e}")
            return 1
        except _Terminated as e:
            self.say(f"received {e}: stopping all steps")
            return 143
        finally:
            self.teardown()
            if self.plan.server_args_file:
                Path(self.plan.server_args_file).unlink(missing_ok=True)
            for s, handler in old.items():
                signal.signal(s, handler)
