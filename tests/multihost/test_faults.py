"""Faults of a multi-host deployment, each against the colocated engine's tokens.

Four hosts (network namespaces, benchmarks/netns_cluster): the router on host 1 (Ray's
head), the prefill pool on host 2, one decode worker on each of hosts 3 and 4; KV over
tcp. Short timeouts (below) keep each fault's wait to seconds:

- a partition between the prefill and decode hosts, idle and in the middle of a push:
  requests complete by local prefill, nothing stays reserved or held on either side,
  a prompt that reaches the prefill worker after its deadline is not computed, and
  once healed the prefill worker is used again;
- a partition between the router and a decode host during a stream: it fails over to
  the other decode host, its text equal to the oracle's, and the cut-off worker serves
  again once healed;
- the loss of decode hosts (every process killed): a stream fails over, a request with
  no decode host left gets a 503 saying so, and `ray start` on the hosts brings the
  workers back (Ray restarts them, the router wires them in);
- a slow link between the pools: at 100 Mbit/s remote prefill still works; a short
  prompt (under the router's threshold) is prefilled where it decodes; at 10 Mbit/s a
  long prompt's TTFT is bounded by the decode worker's deadline (then local prefill).

Each test leaves the deployment as it found it (healed, unlimited, every worker live).
"""

from __future__ import annotations

import threading
import time
import urllib.error
from collections.abc import Iterator

import pytest
import yaml

from engine import LLM, SamplingParams
from tests.multihost.deployment import MODEL, REPO, Deployment, ray_cluster

pytest.importorskip("ray.dashboard", reason="ray job submit needs ray[default]")

ROUTER, PREFILL, DECODES = 1, 2, (3, 4)
DEADLINE_S = 4.0  # prefill_deadline_s: a decode worker waits this long for pushed KV
WORKER_TIMEOUT_S = 5.0  # router.worker_timeout_s: silence before a worker is declared dead
GREEDY = {"temperature": 0.0, "ignore_eos": True}
# Every prompt of its own: a prefix cached by an earlier test would skip the push.
IDLE = "Paged attention keeps keys and values in fixed-size blocks of the cache. " * 6
PUSHING = "Continuous batching lets new requests join a running batch at every step. " * 16
HEALED = "Prefix caching reuses the blocks of a prompt that an earlier request computed. " * 6
STREAMED = "Speculative decoding drafts several tokens and verifies them in one step. " * 5
LOST = "Tensor parallelism splits every weight matrix across the ranks of a group. " * 5
SLOW = "A router sends each request to a decode pool that batches continuously. " * 6
CRAWLING = "Structured outputs constrain every sampled token to a grammar's language. " * 14
SHORT = "Hello there"
MAX_TOKENS = {STREAMED: 120, LOST: 120}


@pytest.fixture(scope="module")
def oracle() -> dict[str, str]:
    llm = LLM(str(MODEL), dtype="float32", num_kv_blocks=256, num_threads=1)
    prompts = [IDLE, PUSHING, HEALED, STREAMED, LOST, SLOW, CRAWLING, SHORT]
    outputs = [llm.generate([p], SamplingParams(max_tokens=MAX_TOKENS.get(p, 8), **GREEDY), use_tqdm=False)[0]
               for p in prompts]
    return {p: o.text for p, o in zip(prompts, outputs, strict=True)}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with ray_cluster("f", ROUTER, {PREFILL: {"prefill_node": 1}, **{h: {"decode_node": 1} for h in DECODES}}) as ray:
        config = yaml.safe_load((REPO / "configs" / "ray-multinode-cpu.yaml").read_text())
        config.update(prefill_deadline_s=DEADLINE_S, transport_options={"timeout_s": 3.0})
        config["router"]["worker_timeout_s"] = WORKER_TIMEOUT_S
        config["decode"]["replicas"] = len(DECODES)
        path = tmp_path_factory.mktemp("faults") / "four-hosts.yaml"
        path.write_text(yaml.safe_dump(config))
        served = Deployment(ray.bed, ray, ROUTER)
        try:
            served.submit(path)
            yield served
        finally:
            served.stop()


@pytest.fixture
def healthy(deployment: Deployment) -> Iterator[Deployment]:
    """The deployment with every worker live and every link whole, before and after."""
    all_live(deployment)
    try:
        yield deployment
    finally:
        bed = deployment.bed
        for a in range(1, bed.hosts + 1):
            for b in range(a + 1, bed.hosts + 1):
                bed.heal(a, b)
            bed.limit(a, None)
        all_live(deployment)


def all_live(deployment: Deployment, timeout: float = 120.0) -> dict[str, dict]:
    return deployment.wait("every worker live, on its own host", lambda w: len(w) == 3 and all(
        row["live"] and row["stats"] for row in w.values()) and {
        deployment.host_of(w[n]) for n in ("decode-0", "decode-1")} == set(DECODES), timeout)


def complete(deployment: Deployment, prompt: str) -> dict:
    return deployment.call("/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS.get(prompt, 8), **GREEDY})


def decode_totals(workers: dict[str, dict]) -> dict[str, int]:
    keys = ("remote", "local", "fallbacks", "kv_bytes_received")
    return {k: sum(workers[n]["stats"][k] for n in ("decode-0", "decode-1")) for k in keys}


def settled(workers: dict[str, dict]) -> bool:
    """Nothing reserved, held, fenced or in flight on any worker: every block free."""
    return all(row["stats"]["free_blocks"] == row["stats"]["num_blocks"] and not row["stats"].get("jobs")
               and not row["stats"].get("quarantined_blocks") and not row["stats"].get("waiting_for_kv")
               for row in workers.values())


@pytest.mark.timeout(300)
def test_a_partition_between_prefill_and_decode_hosts_idle_and_mid_push(healthy: Deployment,
                                                                         oracle: dict[str, str]) -> None:
    deployment, bed = healthy, healthy.bed
    before = deployment.workers()
    computed_before = before["prefill-0"]["stats"]["tokens_computed"]
    for decode in DECODES:
        bed.partition(PREFILL, decode)
    # Idle: the prompt's RemotePrefill cannot reach the prefill worker.
    start = time.monotonic()
    idle = complete(deployment, IDLE)
    assert idle["choices"][0]["text"] == oracle[IDLE]
    assert DEADLINE_S <= time.monotonic() - start < DEADLINE_S + 30
    # Mid-push: the link is slowed so the push takes seconds, and cut once it started.
    for decode in DECODES:
        bed.heal(PREFILL, decode)
        bed.limit(decode, "40mbit")
    answer: dict[str, dict] = {}
    pushing = threading.Thread(target=lambda: answer.update(r=complete(deployment, PUSHING)))
    written = before["prefill-0"]["stats"]["blocks_written"]
    pushing.start()
    deployment.wait("the prefill worker pushing", lambda w: w["prefill-0"]["stats"]["blocks_written"] > written,
                    timeout=30)
    for decode in DECODES:
        bed.partition(PREFILL, decode)
    pushing.join(60)
    assert answer["r"]["choices"][0]["text"] == oracle[PUSHING]
    during = deployment.workers()
    totals = decode_totals(during)
    assert totals["fallbacks"] == decode_totals(before)["fallbacks"] + 2
    assert totals["kv_bytes_received"] == decode_totals(before)["kv_bytes_received"]  # no prompt's KV arrived
    for decode in DECODES:
        bed.heal(PREFILL, decode)
        bed.limit(decode, None)
    # Healed: what was held up arrives; the late prompt is refused, not computed; the
    # half-pushed prompt's job fails; nothing stays held anywhere.
    prefill = before["prefill-0"]["stats"]
    workers = deployment.wait("the late prompt refused, the cut push failed, every block free", lambda w: settled(
        w) and (w["prefill-0"]["stats"]["refused"], w["prefill-0"]["stats"]["failed"]) == (
        prefill["refused"] + 1, prefill["failed"] + 1))
    pushed_tokens = answer["r"]["usage"]["prompt_tokens"] - 1
    assert workers["prefill-0"]["stats"]["tokens_computed"] - computed_before <= pushed_tokens
    # ... and the prefill worker is used again.
    healed = complete(deployment, HEALED)
    assert healed["choices"][0]["text"] == oracle[HEALED]
    after = decode_totals(deployment.workers())
    assert after["remote"] == totals["remote"] + 1 and after["fallbacks"] == totals["fallbacks"]
    assert after["kv_bytes_received"] > totals["kv_bytes_received"]
    assert settled(deployment.wait("every block free", settled, timeout=30))


@pytest.mark.timeout(300)
def test_a_partition_between_router_and_a_decode_host_fails_over_mid_stream(healthy: Deployment,
                                                                           oracle: dict[str, str]) -> None:
    deployment, bed = healthy, healthy.bed
    cut: list[int] = []

    def cut_its_host(event: int) -> None:
        if event == 2:  # streaming: cut the router off the decode host running it
            workers = deployment.workers()
            running = [n for n in ("decode-0", "decode-1") if workers[n]["stats"]["running"]]
            assert len(running) == 1, workers
            cut.append(deployment.host_of(workers[running[0]]))
            bed.partition(ROUTER, cut[0])

    text, events, _ = deployment.stream({"prompt": STREAMED, "max_tokens": MAX_TOKENS[STREAMED], **GREEDY},
                                        cut_its_host)
    assert cut and not [e for e in events if "error" in e]
    assert text == oracle[STREAMED]
    bed.heal(ROUTER, cut[0])
    all_live(deployment)  # the cut-off worker (restarted by its supervisor, or not) serves again
    assert complete(deployment, STREAMED)["choices"][0]["text"] == oracle[STREAMED]


@pytest.mark.timeout(400)
def test_lost_decode_hosts_fail_over_then_503_then_come_back_with_ray_start(healthy: Deployment,
                                                                           oracle: dict[str, str]) -> None:
    deployment, bed = healthy, healthy.bed
    lost: list[int] = []

    def kill_its_host(event: int) -> None:
        if event == 2:
            workers = deployment.workers()
            running = [n for n in ("decode-0", "decode-1") if workers[n]["stats"]["running"]]
            lost.append(deployment.host_of(workers[running[0]]))
            bed.kill_host(lost[0])  # the host's raylet and workers: power lost

    text, events, _ = deployment.stream({"prompt": LOST, "max_tokens": MAX_TOKENS[LOST], **GREEDY}, kill_its_host)
    assert lost and not [e for e in events if "error" in e]
    assert text == oracle[LOST]
    other = next(h for h in DECODES if h != lost[0])
    bed.kill_host(other)  # no decode host left: a clear 503, not a hang
    end = time.monotonic() + 60
    while True:
        try:
            complete(deployment, SHORT)
        except urllib.error.HTTPError as e:
            body = e.read().decode()
            assert e.code == 503 and "no decode worker is alive" in body, body
            break
        assert time.monotonic() < end, "still served with every decode host gone"
        time.sleep(1)
    for host in DECODES:  # the hosts come back: `ray start --address` as after a reboot
        deployment.ray.join(host, {"decode_node": 1})
    all_live(deployment, timeout=180)  # Ray restarts the actors on them; the router wires them in
    assert complete(deployment, LOST)["choices"][0]["text"] == oracle[LOST]


@pytest.mark.timeout(300)
def test_a_slow_link_between_the_pools_keeps_remote_prefill_and_bounds_ttft(healthy: Deployment,
                                                                           oracle: dict[str, str]) -> None:
    deployment, bed = healthy, healthy.bed
    for decode in DECODES:
        bed.limit(decode, "100mbit")
    before = decode_totals(deployment.workers())
    text, _, ttft = deployment.stream({"prompt": SLOW, "max_tokens": 8, **GREEDY})
    middle = decode_totals(deployment.workers())
    assert text == oracle[SLOW] and ttft < DEADLINE_S
    assert middle["remote"] == before["remote"] + 1 and middle["fallbacks"] == before["fallbacks"]  # pushed
    # Below router.remote_prefill_min_tokens: prefilled where it decodes, no push to wait for.
    text, _, ttft = deployment.stream({"prompt": SHORT, "max_tokens": 8, **GREEDY})
    after = decode_totals(deployment.workers())
    assert text == oracle[SHORT] and ttft < DEADLINE_S
    assert after["local"] == middle["local"] + 1 and after["remote"] == middle["remote"]
    # Slower than the deadline allows (10 MB at 10 Mbit/s): prefilled here after it.
    for decode in DECODES:
        bed.limit(decode, "10mbit")
    text, _, ttft = deployment.stream({"prompt": CRAWLING, "max_tokens": 8, **GREEDY})
    last = decode_totals(deployment.workers())
    assert text == oracle[CRAWLING] and DEADLINE_S <= ttft < DEADLINE_S + 30
    assert last["fallbacks"] == after["fallbacks"] + 1
