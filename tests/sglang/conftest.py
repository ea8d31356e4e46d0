"""The REAL SGLang 0.5.23 server on CPU cores, shared by the tests of this folder (one start-up: ~30 s on 2 cores).

It needs the sglang environment (`make .venv/.installed-sglang`; `make test` installs it). Without sglang these
tests skip, unless DAPO_REQUIRE_SGLANG=1 (set by `make test`), where they fail: CI never skips them silently.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from megatron_dapo.engines.sglang.auth import API_KEY_ENV, api_key
from tests.sglang.helpers import ARCH, cpu_server, make_engine, random_weights, save_model

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


def pytest_collection_modifyitems(config, items):
    if HAVE_SGLANG:
        return
    if os.environ.get("DAPO_REQUIRE_SGLANG") == "1":
        raise pytest.UsageError("DAPO_REQUIRE_SGLANG=1 but sglang is not installed: make .venv/.installed-sglang")
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="sglang is not installed (make .venv/.installed-sglang)")
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def initial_weights() -> dict[str, torch.Tensor]:
    return random_weights(ARCH, seed=0)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, initial_weights) -> Path:
    return save_model(tmp_path_factory.mktemp("sglang_tiny"), ARCH, initial_weights)


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory):
    """The session's server; a test that kills it leaves it to the next ``engine`` fixture to restart."""
    # prefill in chunks of 8 tokens: tests/sglang/test_release_idle.py needs a prefill in chunks (the release rule's
    # hard case) and shares this server rather than starting its own (~40 s on 2 cores); outputs are the same
    s = cpu_server(model_dir, tmp_path_factory.mktemp("sglang_logs") / "server.log", "--chunked-prefill-size", "8")
    # started as under `dapo launch`, the key in the starting process's environment: test_security.py checks that its
    # value reaches no environment, command line or log of the server's processes
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(API_KEY_ENV, api_key())
        s.start()
    s.wait_healthy(300)
    yield s
    s.stop()


@pytest.fixture
def engine(server):
    """An engine on the session's server (restarted if a previous test left it dead); never stops the server."""
    if not server.healthy():
        server.restart(300)
    eng = make_engine(server)
    yield eng
    eng.shutdown(stop_servers=False)
