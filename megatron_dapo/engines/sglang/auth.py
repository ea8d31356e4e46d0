"""The per-job API key of the SGLang servers: generated once, given to the servers in a private file, sent by the client,
never on a command line or in a log.

* ``api_key()``: the job's key: ``$DAPO_SGLANG_API_KEY`` (``dapo launch`` sets it for the trainer ranks only), else
  one random key per process (a trainer that starts its own servers).
* ``write_args_file(path, key)``: a server-args YAML for SGLang's ``--config`` (``api-key`` and ``admin-api-key``),
  created with mode 0600 (readable only by the job's user). SGLang 0.5.23 reads ``--config FILE`` in
  ``prepare_server_args`` (srt/server_args.py, srt/utils/server_args_config_parser.py): its keys become flags.
* ``python -m megatron_dapo.engines.sglang.auth CMD...``: runs CMD (``python -m sglang.launch_server ... --config
  FILE``) with its output copied through, the secrets of FILE replaced by ``<redacted>``: SGLang 0.5.23 logs its
  whole ``server_args`` at start-up, keys included (srt/entrypoints/engine.py ``_server_args_for_logging`` redacts
  only watermark secrets).

What the key protects (srt/utils/auth.py ``decide_request_auth``): with ``--api-key`` every endpoint but /health*,
/ready* and /metrics* needs ``Authorization: Bearer <api key>``; with ``--admin-api-key`` the admin endpoints (weight
updates, memory release, flush_cache: ``AuthLevel.ADMIN_OPTIONAL`` in srt/entrypoints/http_server.py) need the admin
key instead. Both are set to the same key, so the trainer holds one secret that opens both. Anything else gets 401.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from megatron_dapo.runs import die_with_parent

API_KEY_ENV = "DAPO_SGLANG_API_KEY"
SECRET_KEYS = ("api-key", "api_key", "admin-api-key", "admin_api_key")
REDACTED = b"<redacted>"
_PROCESS_KEY: str | None = None


def api_key() -> str:
    """The key this process's servers are started with and its requests carry (see the module docstring)."""
    global _PROCESS_KEY
    key = os.environ.get(API_KEY_ENV)
    if key:
        return key
    if _PROCESS_KEY is None:
        _PROCESS_KEY = new_api_key()
    return _PROCESS_KEY


def new_api_key() -> str:
    """256 random bits in hex: SGLang turns the --config file into command-line flags, where a urlsafe key that
    begins with "-" (1 in 64) is read as a flag and the server refuses to start."""
    return secrets.token_hex(32)


def write_args_file(
    path: str | Path, key: str, extra: dict | None = None, keys: tuple[str, ...] = ("api-key", "admin-api-key")
) -> Path:
    """Write a server's ``--config`` YAML with the key under ``keys`` (SGLang's two; vLLM's ``--config`` knows only
    ``api-key``), mode 0600 from its creation (no window where others can read)."""
    import yaml

    path = Path(path)
    if not key or key.startswith("-"):  # SGLang's argparse would read it as a flag (see new_api_key)
        raise ValueError(f"${API_KEY_ENV}: the SGLang API key must be non-empty and must not begin with '-'")
    if path.suffix not in (".yaml", ".yml"):
        raise ValueError(f"{path}: SGLang reads --config files only with a .yaml or .yml suffix")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a file of another mode is replaced, never reused
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump({**(extra or {}), **dict.fromkeys(keys, key)}, f)
    return path


def secrets_of(argv: list[str]) -> list[bytes]:
    """The secret values in the ``--config`` file of a server command line (none without one)."""
    import yaml

    if "--config" not in argv or argv.index("--config") + 1 >= len(argv):
        return []
    try:
        data = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text()) or {}
    except OSError:
        return []
    return sorted({str(data[k]).encode() for k in SECRET_KEYS if data.get(k)}, key=len, reverse=True)


class Redactor:
    """Replaces secrets in a byte stream; holds back only a tail that may be the start of one."""

    def __init__(self, secret_values: list[bytes]):
        self.secrets = [s for s in secret_values if s]
        self.held = b""

    def feed(self, chunk: bytes) -> bytes:
        buf = self.held + chunk
        for s in self.secrets:
            buf = buf.replace(s, REDACTED)
        keep = 0
        for s in self.secrets:  # the longest end of buf that begins a secret
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep :] if keep else b""
        return buf[: len(buf) - keep]

    def flush(self) -> bytes:
        out, self.held = self.held, b""
        return out


def _stop_with_parent(proc: subprocess.Popen, parent: int, grace_s: float = 10.0, every_s: float = 1.0) -> None:
    """A thread: once the process that started this wrapper is gone (the trainer SIGKILLed or crashed: this wrapper
    is then reparented), stop the server, SIGTERM then SIGKILL after ``grace_s``, so that no server outlives its
    trainer. (Not PR_SET_PDEATHSIG on the wrapper: that fires when the *thread* that started it ends, and the trainer
    restarts servers from worker threads.)"""
    while proc.poll() is None:
        if os.getppid() != parent:
            print(f"sglang_auth: the process that started this server (pid {parent}) is gone: stopping the server",
                  file=sys.stderr, flush=True)  # fmt: skip
            proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
            return
        time.sleep(every_s)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m megatron_dapo.engines.sglang.auth CMD [ARGS...] (with --config FILE)", file=sys.stderr)
        return 2
    parent = os.getppid()
    redactor = Redactor(secrets_of(argv))
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        preexec_fn=die_with_parent,  # SIGTERM to the server when this wrapper dies
    )

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, forward)
    threading.Thread(target=_stop_with_parent, args=(proc, parent), daemon=True).start()
    out = sys.stdout.buffer
    fd = proc.stdout.fileno()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except InterruptedError:
            continue
        if not chunk:
            break
        out.write(redactor.feed(chunk))
        out.flush()
    out.write(redactor.flush())
    out.flush()
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
