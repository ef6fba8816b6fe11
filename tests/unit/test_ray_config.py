"""The Ray launcher's config fields, the capacity check and the actor's control channel,
without a Ray cluster: every mistake is named with its path before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ClusterConfig, ConfigError, load_cluster_config
from cluster.ray.actor import WorkerActor
from cluster.ray.resources import missing_resources, pool_bundles, rank_bundles
from security import DeploymentSecret
from workers.control import QueueControl

REPO = Path(__file__).resolve().parents[2]
BASE = {"model": "m", "launcher": "ray", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}


def test_ray_local_config_loads_and_local_stays_the_default() -> None:
    cfg = load_cluster_config(REPO / "configs" / "ray-local.yaml")
    assert cfg.launcher == "ray" and cfg.ray.address == "local" and cfg.ray.num_cpus == 2
    assert pool_bundles(cfg) == {"decode": [{"CPU": 1.0}], "prefill": [{"CPU": 1.0}]}
    assert load_cluster_config(REPO / "configs" / "local.yaml").launcher == "local"


@pytest.mark.parametrize("change,message", [
    ({"launcher": "slurm"}, "launcher: must be one of ('local', 'ray'), got 'slurm'"),
    ({"ray": {"address": "nowhere"}}, "ray.address: must be 'local', 'auto', 'host:port'"),
    ({"ray": {"address": "10.0.0.1:99999"}}, "ray.address: must be"),
    ({"ray": {"address": "auto", "num_cpus": 4}}, "ray.num_cpus: sizes a local start only"),
    ({"ray": {"num_cpus": 0}}, "ray.num_cpus: must be >= 1, got 0"),
    ({"ray": {"strategy": "STRICT_SPREAD"}}, "ray.strategy: must be one of ('PACK', 'SPREAD')"),
    ({"ray": {"placement_timeout_s": 0}}, "ray.placement_timeout_s: must be > 0, got 0"),
    ({"ray": {"decode": {"num_cpus": 0}}}, "ray.decode.num_cpus: must be > 0, got 0"),
    ({"ray": {"prefill": {"num_gpus": -1}}}, "ray.prefill.num_gpus: must be >= 0, got -1"),
    ({"ray": {"prefill": {"resources": {"prefill_node": "yes"}}}},
     "ray.prefill.resources.prefill_node: must be a number, got 'yes'"),
    ({"ray": {"decode": {"resources": {"GPU": 1}}}}, "ray.decode.resources: 'GPU' is not a custom resource"),
    ({"ray": {"decode": {"cpus": 1}}}, "ray.decode.cpus: unknown key"),
    ({"ray": {"adress": "auto"}}, "ray.adress: unknown key"),
    ({"device": "cuda", "transport": "tcp"}, "ray.prefill.num_gpus: must be >= 1 with device 'cuda', got 0"),
])
def test_ray_mistakes_are_named_with_their_path(change: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        ClusterConfig.from_dict({**BASE, **change})
    assert message in str(err.value)


def test_valid_ray_fields() -> None:
    cfg = ClusterConfig.from_dict({**BASE, "device": "cuda", "transport": "nixl", "prefill": {"replicas": 2},
                                   "ray": {"address": "ray://head:10001", "strategy": "SPREAD", "prefill": {
                                       "num_gpus": 1, "resources": {"prefill_node": 1}}, "decode": {"num_gpus": 1}}})
    assert pool_bundles(cfg)["prefill"] == [{"CPU": 1.0, "GPU": 1.0, "prefill_node": 1.0}] * 2
    # Pools with no workers ask for nothing (and need no GPU under device cuda).
    cfg = ClusterConfig.from_dict({**BASE, "device": "cuda", "transport": "nixl", "prefill": {"replicas": 0},
                                   "ray": {"decode": {"num_gpus": 1}}})
    assert list(pool_bundles(cfg)) == ["decode"]


def test_the_shared_kv_store_is_started_by_ray_too_and_asks_for_no_bundle() -> None:
    cfg = ClusterConfig.from_dict({**BASE, "kv_store": {"enabled": True},
                                   "decode": {"replicas": 1, "engine": {"kv_offload_gib": 0.01}}})
    assert cfg.kv_store.enabled and cfg.launcher == "ray"
    assert pool_bundles(cfg) == {"decode": [{"CPU": 1.0}], "prefill": [{"CPU": 1.0}]}  # num_cpus=0, no group


def test_a_tensor_parallel_worker_asks_for_a_bundle_per_rank_on_one_node() -> None:
    cfg = ClusterConfig.from_dict({**BASE, "decode": {"replicas": 2, "engine": {"tensor_parallel_size": 2}},
                                   "ray": {"decode": {"num_cpus": 1.5}}})
    assert rank_bundles(cfg, "decode") == [{"CPU": 1.5}, {"CPU": 1.5}]  # one placement group per worker
    assert pool_bundles(cfg)["decode"] == [{"CPU": 3.0}] * 2  # what one node must hold for each
    assert rank_bundles(cfg, "prefill") == [{"CPU": 1.0}]
    problems = missing_resources(pool_bundles(cfg), [{"CPU": 2.0}, {"CPU": 2.0}])
    assert problems[0].startswith("decode: each worker needs {CPU: 3} on one node")


def test_missing_resources_name_what_no_node_has() -> None:
    bundles = {"decode": [{"CPU": 1.0}] * 2, "prefill": [{"CPU": 1.0, "prefill_node": 1.0}]}
    problems = missing_resources(bundles, [{"CPU": 2.0}])
    assert problems[0].startswith("prefill: each worker needs {CPU: 1, prefill_node: 1} on one node; "
                                  "missing: prefill_node 1 (largest node has 0)")
    assert "all pools together need {CPU: 3, prefill_node: 1}, the cluster has {CPU: 2, prefill_node: 0}" in problems[1]
    # Enough in total but not on one node: a bundle never spans nodes.
    assert "no single node has all of it" in missing_resources(
        {"decode": [{"CPU": 1.0, "GPU": 1.0}]}, [{"CPU": 1.0}, {"GPU": 1.0}])[0]
    assert missing_resources(bundles, [{"CPU": 2.0, "prefill_node": 1.0}, {"CPU": 1.0}]) == []


def test_queue_control_carries_messages_both_ways() -> None:
    control = QueueControl()
    assert not control.poll() and control.from_worker(0.01) is None
    control.send_bytes(b"ready")
    assert control.from_worker(1.0) == b"ready"
    control.to_worker(b"peers")
    assert control.poll() and control.recv_bytes() == b"peers" and not control.poll()


@pytest.mark.timeout(30)
def test_queue_control_waits_until_the_worker_acted_on_a_message() -> None:
    """to_worker(wait_s) returns once the worker has taken the message and polled again
    (it polls only after acting on what it took), False if it never does."""
    import threading
    import time

    control = QueueControl()
    assert control.to_worker(b"peers-1", wait_s=0.2) is False  # nobody reads
    acted: list[bytes] = []

    def worker() -> None:
        for _ in range(2):
            while not control.poll():
                time.sleep(0.01)
            message = control.recv_bytes()
            time.sleep(0.1)  # acting on it
            acted.append(message)
        control.poll()

    thread = threading.Thread(target=worker)
    thread.start()
    assert control.to_worker(b"peers-2", wait_s=10) is True
    assert acted == [b"peers-1", b"peers-2"]
    thread.join(5)


@pytest.mark.timeout(60)
def test_worker_actor_reports_a_failed_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="role must be one of"):
        WorkerActor("router", ClusterConfig.from_dict({"model": "m"}), 0, "127.0.0.1", secret=None)
    actor = WorkerActor("decode", ClusterConfig.from_dict({"model": str(tmp_path / "no-model")}), 0, "127.0.0.1",
                        secret=DeploymentSecret.new())
    with pytest.raises(RuntimeError, match="worker decode-0 failed while starting") as err:
        actor.ready(30)
    assert "no-model" in str(err.value)


@pytest.mark.timeout(30)
def test_an_address_where_no_ray_listens_fails_in_seconds() -> None:
    import socket
    import time

    from cluster.config import RayConfig
    from cluster.ray.resources import PlacementError
    from cluster.ray.workers import connect

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(PlacementError, match=f"no Ray cluster answers at \\S+:{port} "):
        connect(RayConfig(address=f"127.0.0.1:{port}"))
    assert time.monotonic() - start < 10


def test_detach_without_a_lasting_ray_cluster_is_refused_before_anything_starts(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from cluster.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["serve", str(REPO / "configs" / "ray-local.yaml"), "--detach"]) == 2
    assert "--detach needs a Ray cluster that outlives this command" in capsys.readouterr().err
    assert main(["serve", str(REPO / "configs" / "local.yaml"), "--detach"]) == 2
    assert "--detach needs launcher: ray" in capsys.readouterr().err
    # --ray turns a local config into a Ray one (here: a private Ray, so no --detach).
    assert main(["serve", str(REPO / "configs" / "local.yaml"), "--ray", "--detach"]) == 2
    assert "--detach needs a Ray cluster that outlives this command" in capsys.readouterr().err
    assert main(["down", str(REPO / "configs" / "local.yaml")]) == 2
    assert "only a Ray deployment (launcher: ray) runs detached" in capsys.readouterr().err


def test_a_one_host_transport_across_nodes_is_refused_naming_the_field() -> None:
    from cluster.ray.resources import PlacementError, check_one_host_transport

    for transport in ("shm", "cuda_ipc"):
        with pytest.raises(PlacementError, match=f"transport: {transport} moves KV within one host.*2 nodes"):
            check_one_host_transport(transport, {"prefill": ["nodeA"], "decode": ["nodeB"]})
        with pytest.raises(PlacementError, match="2 nodes"):  # one decode worker elsewhere is enough
            check_one_host_transport(transport, {"prefill": ["nodeA"], "decode": ["nodeA", "nodeB"]})
        check_one_host_transport(transport, {"prefill": ["nodeA"], "decode": ["nodeA", "nodeA"]})
        check_one_host_transport(transport, {"prefill": [], "decode": ["nodeA", "nodeB"]})  # no KV moves
    for transport in ("tcp", "nixl", "nccl"):
        check_one_host_transport(transport, {"prefill": ["nodeA"], "decode": ["nodeB"]})
