"""Multi-host tests: hosts are network namespaces of this machine
(benchmarks/netns_cluster). They need root; elsewhere they skip, saying why."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from benchmarks.netns_cluster.bed import BedUnavailable, NetnsCluster, check_available


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
