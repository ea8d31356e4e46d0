"""One port block per job (megatron_dapo/ports.py): components of a job never share a port, jobs get disjoint blocks."""

import pytest

from megatron_dapo.ports import (
    BAND_END,
    BAND_START,
    BLOCK_SIZE,
    BLOCKS,
    MAX_SERVERS_PER_HOST,
    JobPorts,
    find_collisions,
)


def job_ports(p: JobPorts) -> list[int]:
    """Every port a job may use on one host, with the most servers a host can hold."""
    return [p.rendezvous, p.router, p.weight_sync, *(q for k in range(MAX_SERVERS_PER_HOST) for q in p.server(k).all())]


def test_components_of_a_job_never_share_a_port():
    for job in (0, 1, 4242, 12345, 10**9 + 7):
        used = job_ports(JobPorts.for_job(job))
        assert len(used) == len(set(used)), job
        assert min(used) >= BAND_START and max(used) < BAND_END and max(used) < 32768  # below the ephemeral range
        base = JobPorts.for_job(job).base
        assert all(base <= q < base + BLOCK_SIZE for q in used)
    assert find_collisions({n: ("h", q) for n, q in enumerate(job_ports(JobPorts.for_job(7)))}) == []


def test_jobs_with_different_ids_mod_blocks_get_disjoint_blocks():
    assert BLOCKS == 55
    seen = {}
    for job in range(1000, 1000 + BLOCKS):  # BLOCKS consecutive job ids, e.g. running at once on a shared node
        for q in job_ports(JobPorts.for_job(job)):
            assert seen.setdefault(q, job) == job, f"jobs {seen[q]} and {job} share port {q}"
    # job 500, whose rendezvous the old scheme (29500 + id mod 1000) put on the server port 30000: by hand, block
    # 500 mod 55 = 5, base 10000 + 5 * 400 = 12000; router, weight sync next; server 1 at base + 8 + 40
    p = JobPorts.for_job(500)
    assert (p.rendezvous, p.router, p.weight_sync) == (12000, 12001, 12002)
    assert (p.server(1).http, p.server(1).nccl, p.server(1).dist_init) == (12048, 12049, 12050)
    assert p.server(1).all() == range(12048, 12088) and JobPorts.for_job(550) == JobPorts(10000)
    ports = {JobPorts.for_job(j).rendezvous for j in range(BLOCKS)}
    assert not ports & {q for j in range(BLOCKS) for k in range(8) for q in JobPorts.for_job(j).server(k).all()}


def test_block_from_env_and_limits():
    p = JobPorts.for_job("4242")
    assert JobPorts.from_env(p.env()) == p and JobPorts.from_env({}) is None
    assert JobPorts.for_job(None) == JobPorts.for_job("not-a-number") == JobPorts(BAND_START)
    with pytest.raises(ValueError, match="at most 8"):
        p.server(MAX_SERVERS_PER_HOST)


def test_find_collisions_names_both_components():
    clashes = find_collisions({"rendezvous": ("n1", 12000), "server n1": ("n1", range(11990, 12010)),
                               "server n2": ("n2", range(11990, 12010))})  # fmt: skip
    assert clashes == ["server n1 and rendezvous both use port 12000 on n1"]
