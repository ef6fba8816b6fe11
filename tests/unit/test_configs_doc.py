"""The shipped configs and docs/configs.md: every file in configs/ loads, the Ray ones
comment every field, and the doc lists every config dataclass field with its default."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from cluster.autoscale.config import AutoscaleConfig, DecodeBounds, PrefillBounds
from cluster.config import (
    ROLE_FIELDS,
    ClusterConfig,
    KVStoreConfig,
    LocalConfig,
    PoolConfig,
    RayConfig,
    RayPoolConfig,
    RouterConfig,
    TransportOptions,
    load_cluster_config,
)
from cluster.lora_config import LoRAConfig
from cluster.ray.resources import pool_bundles
from cluster.slo_config import SLOConfig
from engine.config import EngineConfig
from engine.speculative.config import SpeculativeConfig

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
# Dataclass -> the path its fields have in the YAML (and in the doc's first column).
SECTIONS: list[tuple[type, str]] = [
    (ClusterConfig, ""), (RouterConfig, "router."), (PoolConfig, "prefill."), (PoolConfig, "decode."),
    (EngineConfig, "<pool>.engine."), (RayConfig, "ray."), (RayPoolConfig, "ray.<pool>."),
    (TransportOptions, "transport_options."), (LocalConfig, "local."), (KVStoreConfig, "kv_store."),
    (SpeculativeConfig, "<pool>.engine.speculative_config."), (AutoscaleConfig, "autoscale."),
    (PrefillBounds, "autoscale.prefill."), (DecodeBounds, "autoscale.decode."), (SLOConfig, "router.slo."),
    (LoRAConfig, "lora."),
]


@pytest.fixture(autouse=True)
def api_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The configs that bind 0.0.0.0 read their API keys from this variable as they load,
    and configs/local-autoscale.yaml its admin key from PDSERVE_ADMIN_KEY."""
    monkeypatch.setenv("PDSERVE_API_KEYS", "sk-test-one,sk-test-two")
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", "admin-test-key")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    assert isinstance(load_cluster_config(path), ClusterConfig)


def test_the_gpu_and_multinode_configs_ask_ray_for_what_they_need() -> None:
    gpu = load_cluster_config(REPO / "configs" / "ray-gpu-1p1d.yaml")
    assert gpu.device == "cuda" and gpu.transport in ("nixl", "cuda_ipc") and gpu.launcher == "ray"
    assert (gpu.prefill.replicas, gpu.decode.replicas) == (1, 1)
    assert pool_bundles(gpu) == {"prefill": [{"CPU": 2.0, "GPU": 1.0}], "decode": [{"CPU": 2.0, "GPU": 1.0}]}
    multi = load_cluster_config(REPO / "configs" / "ray-multinode.yaml")
    assert multi.transport == "nixl" and multi.ray.address == "auto"
    bundles = pool_bundles(multi)  # pools pinned to different node kinds by custom resources
    assert bundles["prefill"][0]["prefill_node"] == 1 and "decode_node" not in bundles["prefill"][0]
    assert bundles["decode"][0]["decode_node"] == 1 and "prefill_node" not in bundles["decode"][0]


@pytest.mark.parametrize("name", ["ray-local.yaml", "ray-gpu-1p1d.yaml", "ray-multinode.yaml"])
def test_ray_configs_comment_every_field(name: str) -> None:
    lines = (REPO / "configs" / name).read_text().splitlines()
    bare = [line for line in lines if re.match(r"\s*[a-z_]+:", line) and "#" not in line]
    assert not bare, f"{name}: fields without a comment: {bare}"


def _doc_default(f: dataclasses.Field) -> str:
    """A dataclass field's default as docs/configs.md writes it (YAML spelling)."""
    if f.default_factory is not dataclasses.MISSING:
        value: Any = f.default_factory()
    elif f.default is dataclasses.MISSING:
        return "required"
    else:
        value = f.default
    if dataclasses.is_dataclass(value):
        return "(mapping)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return str(value)


def test_configs_doc_lists_every_field_with_its_default() -> None:
    rows = dict(re.findall(r"^\| `([^`]+)` \| ([^|]+?) \|", (REPO / "docs" / "configs.md").read_text(), re.M))
    expected = {prefix + f.name: _doc_default(f) for cls, prefix in SECTIONS for f in dataclasses.fields(cls)
                if not (cls is EngineConfig and f.name in ROLE_FIELDS)}
    missing = sorted(set(expected) - set(rows))
    assert not missing, f"docs/configs.md lacks rows for {missing}"
    wrong = {k: (rows[k], v) for k, v in expected.items() if rows[k] != v}
    assert not wrong, f"docs/configs.md defaults (doc, dataclass) disagree: {wrong}"
    stale = sorted(set(rows) - set(expected))
    assert not stale, f"docs/configs.md lists fields no dataclass has: {stale}"
