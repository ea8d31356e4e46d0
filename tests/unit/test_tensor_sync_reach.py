"""Issue 22 #4: outside ``dapo launch`` (torchrun + rollout.server_urls) rank 0 alone sends the ``tensor`` sync: CUDA
IPC handles (shared-memory files on a CPU) open only on their own node, so a server URL on another node is refused at
start-up, before any server is contacted, naming what works there."""

from __future__ import annotations

import socket
import types

import pytest

from megatron_dapo.config.run_config import load_config
from megatron_dapo.config.typed_yaml import ConfigError
from megatron_dapo.loop import rollout as driver

ELSEWHERE = "http://192.0.2.7:30000"  # TEST-NET-1 (RFC 5737): never an address of this machine


def _driver(monkeypatch, *overrides: str):
    made = []
    monkeypatch.setattr(driver, "_make_engine", lambda *a: made.append(a) or types.SimpleNamespace())
    monkeypatch.setattr(driver, "make_weight_sync", lambda cfg, engine: None)
    monkeypatch.delenv("DAPO_LOCAL_SERVER_URL", raising=False)  # not under dapo launch
    cfg = load_config("demo_cpu_sglang", list(overrides))
    return made, lambda: driver.RolloutDriver(cfg, None, None, None, actor=None)


def test_tensor_sync_to_a_server_on_another_node_is_refused_before_it_is_contacted(monkeypatch):
    made, start = _driver(monkeypatch, f'rollout.server_urls=["http://127.0.0.1:30000", "{ELSEWHERE}"]')
    with pytest.raises(ConfigError) as e:
        start()
    msg = str(e.value)
    assert "rollout.weight_sync = 'tensor'" in msg and f"rollout.server_urls ['{ELSEWHERE}'] not on this node" in msg
    assert "`dapo launch`" in msg and "rollout.weight_sync=distributed (or disk)" in msg
    assert made == []  # no engine: no server was started or attached


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", socket.gethostname()])
def test_servers_on_this_node_are_accepted(monkeypatch, host):
    made, start = _driver(monkeypatch, f'rollout.server_urls=["http://{host}:30000"]')
    start()
    assert len(made) == 1


@pytest.mark.parametrize("kind", ["distributed", "disk"])
def test_other_transports_reach_other_nodes(monkeypatch, kind):
    made, start = _driver(monkeypatch, f"rollout.weight_sync={kind}", f'rollout.server_urls=["{ELSEWHERE}"]')
    start()
    assert len(made) == 1
