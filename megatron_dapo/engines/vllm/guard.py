"""Runs INSIDE the vLLM API server (``--middleware megatron_dapo.engines.vllm.guard.RequireKey``; the server's venv):
it imports the standard library and PyYAML only.

vLLM's ``--api-key`` guards only paths under /v1, /v2, /inference and /cohere
(vllm/entrypoints/serve/middleware/authenticate.py:11,59). The routes a weight sync needs, which exist only with
``VLLM_SERVER_DEV_MODE=1``, stay open to anyone who reaches the port: /collective_rpc (any worker method, e.g.
``reload_weights`` from any path), /pause, /resume, /abort_requests, /reset_prefix_cache, /sleep. This middleware
(added by vllm/entrypoints/serve/middleware/register.py:65-74 as ``app.add_middleware(RequireKey)``) asks every
path but the health and version probes for the job's key, the one vLLM reads from the server's ``--config`` file
(mode 0600, ``engines/sglang/auth.write_args_file``)."""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
from pathlib import Path

OPEN_PATHS = ("/health", "/ping", "/version", "/metrics")


def key_from_argv(argv: list[str]) -> str:
    """The ``api-key`` of the ``--config FILE`` on this server's command line; RuntimeError without one (a guard
    without a key would lock the trainer out, or let everyone in)."""
    import yaml

    if "--config" not in argv or argv.index("--config") + 1 >= len(argv):
        raise RuntimeError("megatron_dapo.engines.vllm.guard: the server has no --config file with its api-key")
    data = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text()) or {}
    key = str(data.get("api-key") or "")
    if not key:
        raise RuntimeError("megatron_dapo.engines.vllm.guard: the server's --config file has no api-key")
    return key


class RequireKey:
    """Pure ASGI middleware: ``Authorization: Bearer <key>`` on every HTTP request but ``OPEN_PATHS``, else 401."""

    def __init__(self, app, key: str | None = None):
        self.app = app
        self.digest = hashlib.sha256((key or key_from_argv(sys.argv)).encode()).digest()

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        value = dict(headers).get(b"authorization", b"").decode(errors="replace")
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self.digest)

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] not in ("http", "websocket") or path.startswith(OPEN_PATHS) or self.allowed(scope["headers"]):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
