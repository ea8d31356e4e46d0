"""The ``distributed`` transport into vLLM servers on GPUs: vLLM's own NCCL weight transfer (servers started with
``--weight-transfer-config '{"backend": "nccl"}'``), this process its rank 0. GPU only: it cannot run on a CPU (vLLM's
communicator is NCCL's), so ``tests/unit/test_vllm_nccl_sync.py`` checks our side of the protocol with the
communicator and the HTTP calls recorded. File:line under site-packages/vllm/ (0.32.0):

* Once: every server's workers join a group {this process = rank 0, server i's TP ranks from ``1 + sum(tp before
  it)``}: ``POST /init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset, world_size,
  packed}}`` (entrypoints/serve/rl/online/api_router.py:159-168 -> v1/worker/gpu_worker.py:1484-1500 ->
  distributed/weight_transfer/nccl_common.py:184-221: worker rank = rank_offset + dp * TP·PP + its rank), blocking
  until this process joins with ``nccl_common.trainer_init(..., rank=0)`` (:224-262; a ``StatelessProcessGroup``
  rendezvous, then ``PyNcclCommunicator``). Both sides must enter together: the HTTP calls run in threads meanwhile.
* Each sync, inside ``VLLMDiskSync``'s pause (the prefix cache emptied, verification before the resume):
  ``/start_weight_update`` (the layerwise reload begins, nccl_engine.py:159-166), then per bucket ``POST
  /update_weights {"update_info": {names, dtype_names, shapes}}`` running WHILE this process broadcasts each tensor,
  in that order, from rank 0 (unpacked: the worker allocates each and receives it, nccl_engine.py:216-228; the trainer
  engine's own loop does the same, :331-361), then ``/finish_weight_update {"weight_version": v}`` (:168-174).
* A sync to some servers only (a restarted server's resync) goes through the disk transport: the group's other
  members would wait in every broadcast."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import socket
from collections.abc import Iterable
from typing import Any

import torch

from megatron_dapo.engines.vllm.sync import VLLMDiskSync
from megatron_dapo.types import WeightSyncError

log = logging.getLogger(__name__)


def trainer_endpoint(master_address: str, master_port: int, world_size: int):
    """This process as rank 0 of the transfer group (vLLM's trainer side, nccl_common.py:224-262)."""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    info = {"master_address": master_address, "master_port": master_port, "world_size": world_size}
    return trainer_init(info, rank=0)


class VLLMNcclSync(VLLMDiskSync):
    """Buckets broadcast over vLLM's NCCL weight-transfer group; verified as the disk transport."""

    transport = "distributed"

    def __init__(
        self,
        engine: Any,
        verify: str = "checksum",
        sample_size: int = 16,
        head_dim: int | None = None,
        directory=None,
        master_address: str | None = None,
        master_port: int | None = None,
        endpoint=trainer_endpoint,
    ):
        super().__init__(engine, verify, sample_size, head_dim, directory)
        self.master_address, self.master_port = master_address, master_port
        self._endpoint = endpoint
        self._comm = None
        self._members: list[str] = []
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    def _ensure_group(self, servers: list) -> None:
        from megatron_dapo.actor.dist import free_port

        urls = [s.url for s in servers]
        if self._comm is not None and urls == self._members:
            return
        if self._comm is not None:
            raise WeightSyncError(f"vLLM's NCCL transfer group is {self._members}, now asked for {urls}: a group "
                                  "cannot change its members (restart the job)")  # fmt: skip
        addr = self.master_address or socket.gethostbyname(socket.gethostname())
        port = self.master_port or free_port("0.0.0.0")
        world = 1 + sum(s.tp_size for s in servers)
        bodies = [
            {"init_info": {"master_address": addr, "master_port": port, "world_size": world, "packed": False,
                           "rank_offset": 1 + sum(x.tp_size for x in servers[:i])}}
            for i in range(len(servers))
        ]  # fmt: skip
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        with cf.ThreadPoolExecutor(max_workers=len(servers)) as ex:  # the workers block until rank 0 joins
            joined = [ex.submit(self._post, [s], "/init_weight_transfer_engine", b) for s, b in zip(servers, bodies)]
            self._comm = self._endpoint(addr, port, world)
            for f in joined:
                f.result()
        self._members = urls

    def _send(self, buckets: Iterable[list], version: int, workers: list | None) -> None:
        if workers is not None:  # a resync of restarted servers: they are no longer in the group
            return super()._send(buckets, version, workers)
        servers = self._servers(None)
        self._ensure_group(servers)
        self._post(servers, "/start_weight_update", {})
        with cf.ThreadPoolExecutor(max_workers=1) as ex:
            for bucket in buckets:
                named = [(n, t.detach().to(self.device, self.dtype).contiguous()) for n, t in bucket]
                info = {"names": [n for n, _ in named], "dtype_names": [str(t.dtype).split(".")[-1] for _, t in named],
                        "shapes": [list(t.shape) for _, t in named]}  # fmt: skip
                receiving = ex.submit(self._post, servers, "/update_weights", {"update_info": info})
                stream = torch.cuda.current_stream() if self.device.type == "cuda" else None
                for _, t in named:
                    if receiving.done():  # refused before any broadcast: never wait for peers that will not come
                        receiving.result()
                    self._comm.broadcast(t, src=0, stream=stream)
                receiving.result()
        self._post(servers, "/finish_weight_update", {"weight_version": str(version)})
