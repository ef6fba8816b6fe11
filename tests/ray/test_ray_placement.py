"""A config the Ray cluster can never hold fails within seconds, names what is missing,
and leaves nothing running (this test's own Ray start included)."""

from __future__ import annotations

import time

import pytest
import ray

from cluster.config import RayPoolConfig
from cluster.ray.resources import PlacementError
from cluster.ray.workers import start_ray_workers
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


@pytest.mark.timeout(90)
def test_pdserve_serve_refuses_malformed_and_impossible_configs_in_seconds(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through the command a user runs: a malformed config is named by its path before
    Ray starts; one the cluster cannot hold fails before any actor starts."""
    import yaml

    from cluster.cli import main
    from tests.ray.conftest import MODEL_DIR, REPO

    assert not ray.is_initialized()
    before = descendants()
    config = yaml.safe_load((REPO / "configs" / "ray-local.yaml").read_text())
    malformed = tmp_path / "malformed.yaml"
    malformed.write_text(yaml.safe_dump({**config, "ray": {**config["ray"], "decode": {"num_cpus": 0}}}))
    start = time.monotonic()
    assert main(["serve", str(malformed)]) == 2
    assert "ray.decode.num_cpus: must be > 0, got 0" in capsys.readouterr().err
    assert time.monotonic() - start < 5 and not ray.is_initialized()

    impossible = tmp_path / "impossible.yaml"
    impossible.write_text(yaml.safe_dump({**config, "model": str(MODEL_DIR), "ray": {
        **config["ray"], "prefill": {"num_cpus": 1, "resources": {"prefill_node": 1}}}}))
    start = time.monotonic()
    assert main(["serve", str(impossible), "--port", "1"]) == 2  # never binds: fails first
    err = capsys.readouterr().err
    assert "prefill: each worker needs {CPU: 1, prefill_node: 1} on one node; missing: prefill_node 1" in err
    assert time.monotonic() - start < 30 and not ray.is_initialized()
    end = time.monotonic() + 15
    while descendants() - before and time.monotonic() < end:
        time.sleep(0.2)
    assert not descendants() - before
