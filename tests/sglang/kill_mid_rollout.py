"""A short DAPO training on the real CPU SGLang server whose server is killed (SIGKILL to its process group, by PID)
at the K-th generation request of step S: a fault injected mid-rollout, some samples of the step done, the rest in
flight or not sent yet. Records every sample the engine hands to the trainer, the kill and each resync as JSON.

    python -m tests.sglang.kill_mid_rollout OUT.json STEP K key=value ...       (from the repository root)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from megatron_dapo.config.run_config import load_config
from megatron_dapo.loop.trainer import Trainer


def main(out: str, kill_step: int, kill_at: int, overrides: list[str]) -> None:
    trainer = Trainer(load_config("demo_cpu_sglang", overrides), resume="none")
    engine, server = trainer.rollout.engine, trainer.rollout.engine.servers[0]
    record: dict = {"streams": [], "kills": [], "resyncs": []}
    state = {"step": 0, "requests": 0}
    lock = threading.Lock()

    collect_groups = trainer.schedule.collect_groups

    def collect(step: int):
        state.update(step=step, requests=0)
        return collect_groups(step)

    run_request = engine._run

    def run(key, req, gen, url):
        with lock:
            if state["step"] == kill_step:
                state["requests"] += 1
                if state["requests"] == kill_at and not record["kills"]:
                    pid = server.pid()
                    os.killpg(pid, signal.SIGKILL)
                    server.proc.wait()
                    record["kills"].append({"step": kill_step, "request": kill_at, "pid": pid})
        return run_request(key, req, gen, url)

    generate_stream = engine.generate_stream

    def stream(prompts, sampling, n=1):
        keys: list = []
        record["streams"].append({"step": state["step"], "prompts": len(prompts), "n": n, "keys": keys})
        for group in generate_stream(prompts, sampling, n):
            for s in group:
                assert s.prompt_ids == list(prompts[s.prompt_index]), "a sample came back under another prompt"
                keys.append([s.prompt_index, s.sample_index])
            yield group

    resync = engine.resync

    def recorded_resync(servers):
        record["resyncs"].append({"step": state["step"], "version": engine.weight_version, "pid": server.pid()})
        resync(servers)

    trainer.schedule.collect_groups, engine._run, engine.generate_stream = collect, run, stream
    engine.resync = recorded_resync
    try:
        trainer.run()
    finally:
        record["engine_metrics"] = dict(engine.metrics)
        with open(out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
