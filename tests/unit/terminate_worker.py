"""A process that starts a server as ``dapo train`` does (SGLangServer, its own process group; the stand-in server of
tests/slurm behind the real sglang_auth wrapper), says ``ready``, then waits for a signal. ``argv[1]``: pid dir."""

import sys
import time
from pathlib import Path

from megatron_dapo.engines.sglang.server import SGLangServer
from megatron_dapo.runs import exit_on_terminate

FAKE = Path(__file__).resolve().parents[1] / "slurm" / "fake_sglang_server.py"

if __name__ == "__main__":
    if "--no-handler" not in sys.argv:
        exit_on_terminate()
    pid_dir = sys.argv[1]
    server = SGLangServer("unused", device="cpu", launcher=[sys.executable, str(FAKE), "--pid-dir", pid_dir],
                          log_path=Path(pid_dir) / "server.log")  # fmt: skip
    server.start()
    server.wait_healthy(60)
    print("ready", flush=True)
    time.sleep(600)
