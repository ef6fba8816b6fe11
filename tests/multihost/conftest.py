"""Multi-host tests: hosts are network namespaces of this machine
(benchmarks/netns_cluster). They need root; elsewhere they skip, saying why."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

import pytest

from benchmarks.netns_cluster.bed import BedUnavailable, NetnsCluster, check_available
from benchmarks.netns_cluster.deployment import MODEL
from benchmarks.netns_cluster.ray_hosts import RayHosts


def bed_or_skip(hosts: int, rate: str | None = None, suffix: str = "") -> NetnsCluster:
    try:
        check_available()
    except BedUnavailable as e:
        pytest.skip(f"no multi-host test bed here: {e}")
    # One name per test process (xdist workers run side by side), owned by it: a bed
    # this process leaves behind is swept by the next one.
    return NetnsCluster(f"pdt{os.getpid()}{suffix}", hosts, rate, owner=os.getpid())


@pytest.fixture
def bed3() -> Iterator[NetnsCluster]:
    bed = bed_or_skip(3).up()
    try:
        yield bed
    finally:
        bed.down()


@contextlib.contextmanager
def ray_cluster(suffix: str, head: int, joined: Mapping[int, Mapping[str, float]]) -> Iterator[RayHosts]:
    """A bed of 1 + len(joined) hosts with Ray on each: the head (no pool resources)
    and each joined host with its resources. Skips without root or the demo model;
    checks that nothing of the bed outlives it."""
    if not (MODEL / "model.safetensors").is_file():
        pytest.skip(f"demo model not prepared at {MODEL} (make model)")
    bed = bed_or_skip(1 + len(joined), suffix=suffix).up()
    try:
        ray = RayHosts(bed, head=head)
        ray.start_head()
        for host, resources in joined.items():
            ray.join(host, resources)
        yield ray
    finally:
        bed.down()
    out = os.popen("ip netns list").read()
    assert bed.name not in out and not bed.state_dir.exists(), "the bed outlived the test"
