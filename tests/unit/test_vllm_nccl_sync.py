"""Our side of vLLM's NCCL weight transfer (engines/vllm/nccl_sync.py), which needs GPUs: the HTTP calls and the
broadcasts are recorded instead of sent. The rules checked are vLLM's (file:line in nccl_sync.py): the workers'
init blocks until rank 0 joins (so rank 0 must join while the init calls are in flight), rank offsets follow the
servers' TP sizes, each bucket's /update_weights runs while its tensors are broadcast in the announced order, a
refused announcement raises instead of hanging, and the whole update sits inside the pause with the version last."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from megatron_dapo.engines.vllm.nccl_sync import VLLMNcclSync
from megatron_dapo.types import WeightSyncError

pytestmark = pytest.mark.timeout(60)


@dataclass
class Server:
    url: str
    tp_size: int
    model_path: str | None = None


class Engine:
    dtype = "bfloat16"
    server_timeout = 5.0
    tp_size = 2

    def __init__(self):
        self.servers = [Server("http://a:1", 2), Server("http://b:1", 2)]
        self.version = 0

    def asleep(self, url):
        return False

    def set_weight_version(self, v):
        self.version = v


class Comm:
    def __init__(self, log):
        self.log = log
        self.sent = threading.Semaphore(0)

    def broadcast(self, t, src, stream=None):
        assert src == 0
        self.log.append(("broadcast", t.dtype, tuple(t.shape)))
        self.sent.release()


def _sync(refuse: str | None = None):
    log: list = []
    joined = threading.Event()
    comm = Comm(log)

    def endpoint(addr, port, world):
        log.append(("rank0 joins", addr, port, world))
        joined.set()
        return comm

    def post(servers, path, body, quiet=False):
        if path == "/init_weight_transfer_engine":  # vLLM's workers block in the rendezvous until rank 0 joins
            assert joined.wait(10), "rank 0 must join while the workers' init calls are in flight"
        if path == "/update_weights" and path != refuse:  # the workers receive the announced tensors, then answer
            for _ in body["update_info"]["names"]:
                assert comm.sent.acquire(timeout=10), "the tensors must be broadcast while /update_weights runs"
        if path == refuse:
            raise WeightSyncError(f"{path} refused")
        log.append((path, tuple(s.url for s in servers), body))
        return [None] * len(servers)

    sync = VLLMNcclSync(Engine(), verify="off", master_address="10.0.0.1", master_port=29555, endpoint=endpoint)
    sync._post = post
    return sync, log


BUCKETS = [[("a", torch.ones(2, 3)), ("b", torch.ones(4))], [("c", torch.ones(5, 1))]]


def test_one_sync_follows_vllms_protocol():
    sync, log = _sync()
    sync.sync(BUCKETS, 3)
    paths = [e[0] for e in log]
    assert paths[0] == "/pause?mode=wait&clear_cache=true" and paths[-1] == "/resume"
    inits = sorted(e[2]["init_info"]["rank_offset"] for e in log if e[0] == "/init_weight_transfer_engine")
    assert inits == [1, 3]  # server 0's 2 TP ranks at 1-2, server 1's at 3-4
    assert ("rank0 joins", "10.0.0.1", 29555, 5) in log
    body = next(e[2] for e in log if e[0] == "/init_weight_transfer_engine")["init_info"]
    assert body["world_size"] == 5 and body["packed"] is False and body["master_port"] == 29555
    after = paths[paths.index("/start_weight_update") :]
    assert after == ["/start_weight_update", "broadcast", "broadcast", "/update_weights", "broadcast", "/update_weights",
                     "/finish_weight_update", "/update_weight_version", "/resume"]  # fmt: skip
    updates = [e[2]["update_info"] for e in log if e[0] == "/update_weights"]
    assert updates[0] == {"names": ["a", "b"], "dtype_names": ["bfloat16"] * 2, "shapes": [[2, 3], [4]]}
    assert [e[1:] for e in log if e[0] == "broadcast"] == [(torch.bfloat16, (2, 3)), (torch.bfloat16, (4,)),
                                                           (torch.bfloat16, (5, 1))]  # fmt: skip
    assert next(e[2] for e in log if e[0] == "/finish_weight_update") == {"weight_version": "3"}
    assert sync.engine.version == 3
    log.clear()
    sync.sync(BUCKETS, 4)  # the group stays: no second rendezvous
    assert not [e for e in log if e[0] in ("/init_weight_transfer_engine", "rank0 joins")]


def test_a_refused_announcement_raises_and_the_servers_resume():
    sync, log = _sync(refuse="/update_weights")
    with pytest.raises(WeightSyncError, match="refused"):
        sync.sync(BUCKETS, 1)
    assert log[-1][0] == "/resume" and sync.engine.version == 0


def test_a_restarted_servers_resync_goes_through_disk(tmp_path):
    sync, log = _sync()
    sync.directory = tmp_path
    sync.sync(BUCKETS, 1, workers=[sync.engine.servers[1]])
    reload = [e for e in log if e[0] == "/collective_rpc"]
    assert reload and reload[0][1] == ("http://b:1",) and reload[0][2]["method"] == "reload_weights"
    assert not [e for e in log if e[0] in ("/init_weight_transfer_engine", "broadcast")]
