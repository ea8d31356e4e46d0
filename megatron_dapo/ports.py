"""The TCP ports of one job: rendezvous, SGLang router, weight-sync group and each SGLang server, from one block.

    ports = JobPorts.for_job(job_id)            # the block of this Slurm job (job id -> one of BLOCKS blocks)
    ports.rendezvous, ports.router, ports.weight_sync
    ports.server(k)                             # the k-th server on a host: http, nccl, dist_init (+ a band after it)
    ports.env()                                 # DAPO_PORT_BASE for the job's steps; JobPorts.from_env() reads it back

Layout of a block of ``BLOCK_SIZE`` ports starting at ``base``::

    base + 0   rendezvous (MASTER_PORT of torch.distributed)
    base + 1   SGLang router
    base + 2   weight-sync process group (trainer rank 0 + the servers' TP ranks; its TCP store)
    base + 8 + 40 k ... + 40 (k + 1)    server k on one host: HTTP, NCCL (--nccl-port), then its dist-init port and
                                        the DIST_INIT_BAND ports SGLang takes after it (one per DP rank + its own)

so the components of one job never share a port, up to ``MAX_SERVERS_PER_HOST`` servers on a host (emulated nodes
that share an address count as one host). Blocks tile ``[BAND_START, BAND_END)``: below Linux's ephemeral range
(32768-60999, where every outgoing connection takes its local port), above the ports of common services. Job id
``j`` gets block ``j mod BLOCKS``: two jobs sharing a node get disjoint blocks unless their ids differ by a multiple
of BLOCKS (55); job ids are consecutive, so that means ~55 jobs submitted between them that are no longer running.
The old scheme (MASTER_PORT = 29500 + job id mod 1000, servers on 30000) put a rendezvous on a server port for job
ids ending in 500 and inside SGLang's NCCL band (random ports from the server port + 100) for a third of the others.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

BAND_START, BAND_END = 10_000, 32_000
SERVER_OFFSET, SERVER_STRIDE, MAX_SERVERS_PER_HOST = 8, 40, 8
DIST_INIT_BAND = SERVER_STRIDE - 3  # after the dist-init port: SGLang's per-DP-rank ports (30 + DP size, DP <= 7)
BLOCK_SIZE = 400  # >= SERVER_OFFSET + MAX_SERVERS_PER_HOST * SERVER_STRIDE = 328
BLOCKS = (BAND_END - BAND_START) // BLOCK_SIZE
PORT_BASE_ENV = "DAPO_PORT_BASE"


@dataclass(frozen=True)
class ServerPorts:
    http: int
    nccl: int
    dist_init: int  # SGLang also takes ports after it (DIST_INIT_BAND)

    def all(self) -> range:
        return range(self.http, self.dist_init + DIST_INIT_BAND + 1)


@dataclass(frozen=True)
class JobPorts:
    base: int

    @classmethod
    def for_job(cls, job_id: str | int | None) -> JobPorts:
        """The block of a Slurm job; block 0 outside Slurm (no job id)."""
        slot = int(job_id) % BLOCKS if job_id is not None and str(job_id).isdigit() else 0
        return cls(BAND_START + slot * BLOCK_SIZE)

    @classmethod
    def from_env(cls, env: dict | None = None) -> JobPorts | None:
        """The block the launcher chose ($DAPO_PORT_BASE), or None outside ``dapo launch``."""
        value = (os.environ if env is None else env).get(PORT_BASE_ENV)
        return cls(int(value)) if value else None

    def env(self) -> dict[str, str]:
        return {PORT_BASE_ENV: str(self.base)}

    @property
    def rendezvous(self) -> int:
        return self.base

    @property
    def router(self) -> int:
        return self.base + 1

    @property
    def weight_sync(self) -> int:
        return self.base + 2

    def server(self, k: int) -> ServerPorts:
        """Ports of the ``k``-th server (0-based) on one host."""
        if not 0 <= k < MAX_SERVERS_PER_HOST:
            raise ValueError(f"server {k} on one host: at most {MAX_SERVERS_PER_HOST} fit in a port block")
        http = self.base + SERVER_OFFSET + k * SERVER_STRIDE
        return ServerPorts(http=http, nccl=http + 1, dist_init=http + 2)


def find_collisions(uses: dict[str, tuple[str, range | int]]) -> list[str]:
    """``{component: (host, port or ports)}`` -> one message per port two components of a job use on one host."""
    owner: dict[tuple[str, int], str] = {}
    clashes = []
    for name, (host, ports) in uses.items():
        for port in [ports] if isinstance(ports, int) else ports:
            other = owner.setdefault((host, port), name)
            if other != name:
                clashes.append(f"{name} and {other} both use port {port} on {host}")
    return clashes
