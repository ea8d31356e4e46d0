"""Stand-in for ``python -m sglang.launch_server`` in the Slurm launcher tests.

Kept because the real server cannot be made to play this part: the launcher plans GPU servers (``--gpus-per-node``,
one per node, several emulated nodes sharing this machine's 2 cores), and what these tests check is the supervision
of the job steps (health polling, a crash on one node tearing the others down) within seconds. The real SGLang server
on CPU cores (~30 s and ~2.4 GB per start) is tested in tests/sglang.

Serves ``GET /health`` (200) until SIGTERM. ``--fail-on NODE`` makes the copy on Slurm node NODE exit with
``--code`` after ``--fail-after`` seconds (healthy until then), as a crashing server would. ``--pid-dir`` records each copy's pid
so that tests can check that the launcher stopped the healthy ones. ``--load-s S`` prints a progress bar (carriage
returns, as SGLang's weight loading does) for S seconds before it listens. ``--config FILE`` (the job's server-args
YAML, as SGLang's): its keys are printed as SGLang 0.5.23 prints its ``server_args`` at start-up, API key included,
so a launcher test sees the key in the log unless the ``sglang_auth`` wrapper redacts it.
"""

import argparse
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server API)
        ok = self.path.split("?")[0] == "/health"
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(b"ok" if ok else b"not found")

    def log_message(self, *args):
        pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--fail-on", default="")
    ap.add_argument("--fail-after", type=float, default=0.0)
    ap.add_argument("--code", type=int, default=1)
    ap.add_argument("--pid-dir")
    ap.add_argument("--load-s", type=float, default=0.0)
    ap.add_argument("--node", default=os.environ.get("SLURMD_NODENAME", "?"), help="default: the Slurm node")
    ap.add_argument("--config")
    args, _ = ap.parse_known_args()  # SGLang's own flags (--model-path ...) when started by SGLangServer
    node = args.node
    if args.config:  # what SGLang logs (srt/entrypoints/engine.py): the server_args, secrets in the clear
        import yaml

        conf = yaml.safe_load(Path(args.config).read_text())
        print("server_args=" + repr({k.replace("-", "_"): v for k, v in conf.items()}), flush=True)
    if args.pid_dir:
        Path(args.pid_dir).mkdir(parents=True, exist_ok=True)
        Path(args.pid_dir, f"server-{node}.pid").write_text(str(os.getpid()))
    print(f"fake sglang server on {node}, port {args.port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    for i in range(int(args.load_s * 10)):
        print(f"\rLoading safetensors checkpoint shards: {100 * i // int(args.load_s * 10)}%", end="", flush=True)
        time.sleep(0.1)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if node == args.fail_on:
        time.sleep(args.fail_after)
        print(f"fake sglang server on {node}: simulated crash, exit {args.code}", flush=True)
        os._exit(args.code)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
