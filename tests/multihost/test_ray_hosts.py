"""pdserve on three hosts (network namespaces, benchmarks/netns_cluster) as a user
deploys it: `ray start --head` on host 1 (the router's), `ray start --address` on hosts
2 and 3 marked prefill_node and decode_node, then `ray job submit` of
configs/ray-multinode-cpu.yaml. Each pool lands on its own host, every worker listens on
its host's address, the prompt's KV crosses hosts over tcp, and the tokens equal the
colocated engine's. A one-host transport across hosts is refused, naming the field.
Everything the bed started is gone afterwards."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from benchmarks.netns_cluster.bed import NetnsCluster
from benchmarks.netns_cluster.ray_hosts import RayHosts
from engine import LLM, SamplingParams
from tests.multihost.conftest import bed_or_skip

pytest.importorskip("ray.dashboard", reason="ray job submit needs ray[default]")

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "SmolLM2-135M-Instruct"
KEY = "sk-multihost"
ROUTER, PREFILL, DECODE = 1, 2, 3
PROMPT = "Paged attention keeps keys and values in fixed-size blocks of the cache. " * 6
PARAMS = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
RUNTIME_ENV = {"excludes": ["/.git", "/.venv", "/models", "/results"], "env_vars": {"PDSERVE_API_KEYS": KEY}}
SERVE_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[NetnsCluster, RayHosts]]:
    if not (MODEL / "model.safetensors").is_file():
        pytest.skip(f"demo model not prepared at {MODEL} (make model)")
    bed = bed_or_skip(3, suffix="r").up()
    try:
        ray = RayHosts(bed, head=ROUTER)
        ray.start_head()
        ray.join(PREFILL, {"prefill_node": 1})
        ray.join(DECODE, {"decode_node": 1})
        yield bed, ray
    finally:
        bed.down()
    out = os.popen("ip netns list").read()
    assert bed.name not in out and not bed.state_dir.exists(), "the bed outlived the test"


def call(bed: NetnsCluster, path: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    """An HTTP call to the router from the router's host (the bed's hosts are reached
    from inside the bed only)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{bed.address(ROUTER)}:8000{path}", data=data, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with bed.inside(ROUTER):
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return json.loads(r.read())


def wait_serving(bed: NetnsCluster, ray: RayHosts, job: str) -> None:
    end = time.monotonic() + SERVE_TIMEOUT_S
    while True:
        try:
            call(bed, "/health", timeout=2)
            return
        except (OSError, urllib.error.URLError):
            pass
        status = ray.job_status(job)
        assert status in ("PENDING", "RUNNING"), f"the job ended ({status}) before serving:\n{ray.job_logs(job)}"
        assert time.monotonic() < end, f"no /health within {SERVE_TIMEOUT_S:g} s:\n{ray.job_logs(job)}"
        time.sleep(1)


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


@pytest.fixture(scope="module")
def deployment(hosts) -> Iterator[tuple[NetnsCluster, RayHosts]]:
    bed, ray = hosts
    ray.submit("serve", ["pdserve", "serve", "configs/ray-multinode-cpu.yaml", "--model", str(MODEL)], REPO,
               RUNTIME_ENV)
    try:
        wait_serving(bed, ray, "serve")
        yield bed, ray
    finally:
        if ray.job_status("serve") in ("PENDING", "RUNNING"):
            ray.stop_job("serve")


@pytest.mark.timeout(420)
def test_pools_on_their_own_hosts_serve_the_colocated_engines_tokens_with_kv_across_hosts(deployment) -> None:
    bed, _ = deployment
    status = call(bed, "/status")
    addresses = {w["name"]: w["address"] for w in status["decode_workers"] + status["prefill_workers"]}
    assert addresses.keys() == {"decode-0", "prefill-0"}
    assert addresses["decode-0"].startswith(f"tcp://{bed.address(DECODE)}:")
    assert addresses["prefill-0"].startswith(f"tcp://{bed.address(PREFILL)}:")
    before = status["decode_workers"][0]["stats"]
    answer = call(bed, "/v1/completions", {"prompt": PROMPT, **PARAMS})["choices"][0]["text"]
    after = call(bed, "/status")["decode_workers"][0]["stats"]
    expected = LLM(str(MODEL), dtype="float32", num_kv_blocks=64, num_threads=1).generate(
        [PROMPT], SamplingParams(**PARAMS), use_tqdm=False)[0].text
    assert answer == expected
    # prefilled on host 2, its KV pushed to host 3 over tcp
    assert after["remote"] == before["remote"] + 1 and after["fallbacks"] == before["fallbacks"]
    assert after["kv_bytes_received"] > before["kv_bytes_received"]
