"""Locked-down servers (issue 16, item 5) on the REAL SGLang 0.5.23 server: the job's API key is required for
generation and weight updates, and it shows in no command line, no log, and a file readable only by the job's user."""

from __future__ import annotations

import os
import stat

import psutil
import pytest

from megatron_dapo.engines.sglang.auth import api_key, secrets_of
from megatron_dapo.engines.sglang.server import ServerRequestError, http_call

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


def test_requests_without_the_key_are_refused(engine, tmp_path):
    url, key = engine.servers[0].url, api_key()
    for path, body in [("/generate", GENERATE), ("/update_weights_from_disk", {"model_path": str(tmp_path)}),
                       ("/release_memory_occupation", {}), ("/get_server_info", None)]:  # fmt: skip
        for wrong in ("", "not-the-key", key[:-1]):
            with pytest.raises(ServerRequestError, match="HTTP 401"):
                http_call(url, path, body, timeout=30, key=wrong)
    assert len(http_call(url, "/generate", GENERATE, timeout=60)["output_ids"]) == 2  # the job's key: accepted
    assert http_call(url, "/health", timeout=30, key="") is None  # liveness stays open (probes carry no secret)


def test_the_key_is_in_no_command_line_no_log_and_a_private_file(server):
    key = api_key().encode()
    assert stat.S_IMODE(os.stat(server.args_file).st_mode) == 0o600
    assert secrets_of(server.argv()) == [key]  # the file holds it, for the server to read
    group = [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == server.pid()]
    assert len(group) >= 2, "the redacting wrapper and the server"
    for p in group:
        assert key not in b"\0".join(s.encode() for s in p.cmdline()), f"the key is on the command line of {p}"
        env = _environ(p.pid)  # the server was started with the key in its parent's environment (conftest.py)
        assert key not in env and b"DAPO_SGLANG_API_KEY" not in env, f"the key is in the environment of {p}"
    log = server.log_path.read_bytes()
    assert b"'api_key': '<redacted>'" in log, "SGLang logs its server_args: the wrapper must have redacted them"
    assert key not in log
    listening = {c.laddr for p in group for c in _connections(p) if c.status == psutil.CONN_LISTEN}
    assert (server.host, server.port) in {(a.ip, a.port) for a in listening}
    assert server.host == "127.0.0.1" and not any(
        a.ip in ("0.0.0.0", "::") and a.port == server.port for a in listening
    )


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _environ(pid: int) -> bytes:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f.read()


def _connections(p: psutil.Process):
    try:
        return p.net_connections(kind="inet")
    except (psutil.AccessDenied, psutil.NoSuchProcess):
        return []


def test_every_generated_key_survives_sglangs_own_config_parser(tmp_path):
    """SGLang 0.5.23 turns the --config file into command-line flags (srt/server_args.py ``prepare_server_args``):
    a key that begins with "-" is read as a flag and the server refuses to start. Ours never begin with one (token_urlsafe
    keys did, 1 in 64: seen in a bench run), and such a key given in $DAPO_SGLANG_API_KEY is refused first."""
    import yaml
    from sglang.srt.server_args import prepare_server_args

    from megatron_dapo.engines.sglang.auth import new_api_key, write_args_file

    path = tmp_path / "args.yaml"
    for _ in range(200):
        key = new_api_key()
        write_args_file(path, key)
        args = prepare_server_args(["--model-path", str(tmp_path), "--config", str(path)])
        assert args.api_key == args.admin_api_key == key
    path.write_text(yaml.safe_dump({"api-key": "-abc", "admin-api-key": "-abc"}))
    with pytest.raises(SystemExit):  # what the refusal below prevents
        prepare_server_args(["--model-path", str(tmp_path), "--config", str(path)])
    with pytest.raises(ValueError, match="must not begin with '-'"):
        write_args_file(path, "-abc")
