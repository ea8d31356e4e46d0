"""The per-job server key without a server (tests/sglang/test_security.py has the real one): the args file, the
output redaction of the wrapper, the key's source."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import yaml

from megatron_dapo.rollout import sglang_auth
from megatron_dapo.rollout.sglang_auth import Redactor, secrets_of, write_args_file


def test_args_file_is_private_and_read_back(tmp_path):
    path = tmp_path / "sub" / "args.yaml"
    path.parent.mkdir()
    path.write_text("old")
    os.chmod(path, 0o644)  # an existing file of another mode is replaced, not reused
    write_args_file(path, "k3y")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert yaml.safe_load(path.read_text()) == {"api-key": "k3y", "admin-api-key": "k3y"}
    assert secrets_of(["x", "--config", str(path)]) == [b"k3y"] and secrets_of(["x"]) == []


def test_redactor_replaces_secrets_split_across_chunks():
    r = Redactor([b"s3cret-key"])
    stream = [b"x='s3c", b"ret-k", b"ey' s3cret-", b"nope s3", b"cret-key\n"]
    out = b"".join(r.feed(c) for c in stream) + r.flush()
    assert out == b"x='<redacted>' s3cret-nope <redacted>\n"
    assert Redactor([b"abc"]).feed(b"progress 10%\r") == b"progress 10%\r", "output that cannot be a key is not held"


def test_wrapper_redacts_forwards_the_exit_code_and_hides_the_env_key(tmp_path):
    args = write_args_file(tmp_path / "a.yaml", "TOPSECRET")
    child = "import os, sys; print('key=TOPSECRET', os.environ.get('DAPO_SGLANG_API_KEY')); sys.exit(3)"
    env = {**os.environ, "DAPO_SGLANG_API_KEY": "TOPSECRET"}
    cmd = [
        sys.executable,
        "-m",
        "megatron_dapo.rollout.sglang_auth",
        sys.executable,
        "-c",
        child,
        "--config",
        str(args),
    ]
    out = subprocess.run(cmd, capture_output=True, env=env, timeout=60)
    assert out.returncode == 3 and out.stdout == b"key=<redacted> None\n"


def test_key_from_the_environment_else_one_per_process(monkeypatch):
    monkeypatch.setenv("DAPO_SGLANG_API_KEY", "from-env")
    assert sglang_auth.api_key() == "from-env"
    monkeypatch.delenv("DAPO_SGLANG_API_KEY")
    first = sglang_auth.api_key()
    assert len(first) >= 32 and sglang_auth.api_key() == first
