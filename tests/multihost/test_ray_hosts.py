"""pdserve on three hosts (network namespaces, benchmarks/netns_cluster) as a user
deploys it: `ray start --head` on host 1 (the router's), `ray start --address` on hosts
2 and 3 marked prefill_node and decode_node, then `ray job submit` of
configs/ray-multinode-cpu.yaml. Each pool lands on its own host, every worker listens on
its host's address, the prompt's KV crosses hosts (over tcp, and in a second deployment
over nixl, UCX over TCP), and the tokens equal the colocated engine's. A one-host
transport across hosts is refused, naming the field. Everything the bed started is gone
afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from benchmarks.netns_cluster.bed import NetnsCluster
from benchmarks.netns_cluster.deployment import MODEL, REPO, RUNTIME_ENV, UCX_ACROSS_THE_BED, Deployment
from benchmarks.netns_cluster.ray_hosts import RayHosts
from engine import LLM, SamplingParams
from tests.multihost.conftest import ray_cluster

pytest.importorskip("ray.dashboard", reason="ray job submit needs ray[default]")

ROUTER, PREFILL, DECODE = 1, 2, 3
PROMPT = "Paged attention keeps keys and values in fixed-size blocks of the cache. " * 6
PARAMS = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[NetnsCluster, RayHosts]]:
    with ray_cluster("r", ROUTER, {PREFILL: {"prefill_node": 1}, DECODE: {"decode_node": 1}}) as ray:
        yield ray.bed, ray


@pytest.mark.timeout(240)
def test_a_one_host_transport_between_pools_on_different_hosts_is_refused(hosts, tmp_path: Path) -> None:
    bed, ray = hosts
    config = yaml.safe_load((REPO / "configs" / "ray-multinode-cpu.yaml").read_text())
    path = tmp_path / "shm-across-hosts.yaml"
    path.write_text(yaml.safe_dump({**config, "transport": "shm", "model": str(MODEL)}))
    ray.submit("refused", ["pdserve", "serve", str(path)], REPO, RUNTIME_ENV)
    end = time.monotonic() + 180
    while (status := ray.job_status("refused")) in ("PENDING", "RUNNING"):
        assert time.monotonic() < end, ray.job_logs("refused")
        time.sleep(1)
    logs = ray.job_logs("refused")
    assert status == "FAILED" and "transport: shm moves KV within one host" in logs, logs


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def deployment(request: pytest.FixtureRequest, hosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """configs/ray-multinode-cpu.yaml as it is (KV over tcp), and with nixl (UCX over TCP)."""
    bed, ray = hosts
    transport = request.param
    if transport == "nixl":
        pytest.importorskip("nixl", reason="the nixl transport needs the nixl package")
    config = yaml.safe_load((REPO / "configs" / "ray-multinode-cpu.yaml").read_text())
    path = tmp_path_factory.mktemp(transport) / "ray-multinode-cpu.yaml"
    path.write_text(yaml.safe_dump({**config, "transport": transport}))
    served = Deployment(bed, ray, ROUTER, job=f"serve-{transport}")
    try:
        yield served.submit(path, UCX_ACROSS_THE_BED if transport == "nixl" else None)
    finally:
        served.stop()


@pytest.mark.timeout(420)
def test_pools_on_their_own_hosts_serve_the_colocated_engines_tokens_with_kv_across_hosts(
        deployment: Deployment) -> None:
    bed = deployment.bed
    workers = deployment.workers()
    assert workers.keys() == {"decode-0", "prefill-0"}
    assert workers["decode-0"]["address"].startswith(f"tcp://{bed.address(DECODE)}:")
    assert workers["prefill-0"]["address"].startswith(f"tcp://{bed.address(PREFILL)}:")
    before = workers["decode-0"]["stats"]
    transport = deployment.job.removeprefix("serve-")
    # the wire its KV crosses, as the worker reports it: TCP either way here (no RDMA device)
    assert (before["kv_transport"], before["kv_fabric"]) == (transport, "tcp")
    answer = deployment.call("/v1/completions", {"prompt": PROMPT, **PARAMS})["choices"][0]["text"]
    # its bytes are counted when the prefill worker's PrefillDone comes, which may follow the answer
    after = deployment.wait("the push's bytes counted", lambda w: w["decode-0"]["stats"][
        "kv_bytes_received"] > before["kv_bytes_received"], timeout=30)["decode-0"]["stats"]
    expected = LLM(str(MODEL), dtype="float32", num_kv_blocks=64, num_threads=1).generate(
        [PROMPT], SamplingParams(**PARAMS), use_tqdm=False)[0].text
    assert answer == expected
    # prefilled on host 2, its KV pushed to host 3
    assert after["remote"] == before["remote"] + 1 and after["fallbacks"] == before["fallbacks"]
    assert after["kv_bytes_received"] > before["kv_bytes_received"]
