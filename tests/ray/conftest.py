"""Ray tests: Ray stays on 127.0.0.1 with token auth on (Ray's default: every RPC and
the job server need the token; one made for the test session, held in the environment
that Ray's processes and CLI inherit, never written to a file), each module
starts at most one Ray (seconds and ~1 GiB on a 2-core machine), and each test checks
that what it started is gone afterwards."""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from cluster import demo_model as demo
from cluster.config import ClusterConfig, load_cluster_config

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = demo.default_models_dir() / demo.DEMO_MODELS["smollm2"].dir_name
RAY_ENV = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Ray's driver reads its auth settings once per process, when ray is first imported (by
# the test modules here, after this file): set for the whole session, not per module.
os.environ.update({key: RAY_ENV[key] for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")})


@pytest.fixture(scope="module", autouse=True)
def ray_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in RAY_ENV.items():
            mp.setenv(key, value)
        mp.delenv("RAY_ADDRESS", raising=False)  # never join a cluster we did not start
        yield


def ray_local_config(port: int = 8000, **ray_changes: object) -> ClusterConfig:
    """configs/ray-local.yaml with the prepared demo model (skips if it is not built)."""
    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.skip(f"demo model not prepared at {MODEL_DIR} (make model)")
    cfg = load_cluster_config(REPO / "configs" / "ray-local.yaml")
    return dataclasses.replace(cfg, model=str(MODEL_DIR), router=dataclasses.replace(cfg.router, port=port),
                               ray=dataclasses.replace(cfg.ray, **ray_changes))


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}


def assert_ray_gone(before: set[int], what: str = "Ray processes") -> None:
    """After a deployment stopped: Ray disconnected, and none of the processes started
    since `before` (descendants() then) still runs, within 15 s."""
    import ray

    assert not ray.is_initialized()
    end = time.monotonic() + 15
    while descendants() - before and time.monotonic() < end:
        time.sleep(0.2)
    assert not descendants() - before, f"{what} outlived the deployment"
