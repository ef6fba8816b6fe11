"""A config the Ray cluster can never hold fails within seconds, names what is missing,
and leaves nothing running (this test's own Ray start included)."""

from __future__ import annotations

import time

import pytest
import ray

from cluster.config import RayPoolConfig
from cluster.ray_launcher import start_ray_workers
from cluster.ray_resources import PlacementError
from tests.ray.conftest import descendants, ray_local_config


@pytest.mark.timeout(90)
def test_impossible_request_fails_fast_naming_what_is_missing_and_leaves_nothing() -> None:
    assert not ray.is_initialized(), "another test left Ray connected in this process"
    before = descendants()
    config = ray_local_config(decode=RayPoolConfig(num_cpus=1, resources={"decode_node": 1}))
    start = time.monotonic()
    with pytest.raises(PlacementError) as err:
        start_ray_workers(config)
    elapsed = time.monotonic() - start
    assert "decode: each worker needs {CPU: 1, decode_node: 1} on one node; missing: decode_node 1" in str(err.value)
    assert elapsed < 30, f"took {elapsed:.1f} s (Ray start included)"
    assert not ray.is_initialized()
    end = time.monotonic() + 15  # the Ray this test started (GCS, raylet, workers) is gone
    while descendants() - before and time.monotonic() < end:
        time.sleep(0.2)
    assert not descendants() - before
