"""Faults of a multi-host deployment, each against the colocated engine's tokens.

Four hosts (network namespaces, benchmarks/netns_cluster): the router on host 1 (Ray's
head), the prefill pool on host 2, one decode worker on each of hosts 3 and 4; KV over
tcp. Short timeouts (tests/fuzz/hosts.py) keep each fault's wait to seconds:

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
  prompt (under the router's threshold) is prefilled where it decodes; at 5 Mbit/s a
  long prompt's TTFT is bounded by the decode worker's deadline (then local prefill);
- a random schedule of those cuts and slow links while requests stream (one seed of
  tests/fuzz/hosts.py): no request fails, every text is the oracle's, and the
  deployment settles with every block free.

Each test leaves the deployment as it found it (healed, unlimited, every worker live).
"""

from __future__ import annotations

import threading
import time
import urllib.error
from collections.abc import Callable, Iterator

import pytest

from benchmarks.netns_cluster.deployment import MODEL, Deployment
from engine import LLM, SamplingParams
from tests.fuzz.hosts import (
    DEADLINE_S,
    DECODES,
    GREEDY,
    PREFILL,
    ROUTER,
    TextOracle,
    run_hosts_seed,
    settled,
    write_config,
)
from tests.multihost.conftest import ray_cluster

pytest.importorskip("ray.dashboard", reason="ray job submit needs ray[default]")

PUSH_RATE = "40mbit"  # the mid-push test's links: a 226-token prompt's 11 MB take about 2 s, well inside both
# Every prompt of its own: a prefix cached by an earlier test would skip the push.
IDLE = "Paged attention keeps keys and values in fixed-size blocks of the cache. " * 6
PUSHING = "Continuous batching lets new requests join a running batch at every step. " * 16
PUSHED = "Chunked prefill splits a long prompt into pieces that share steps with decodes. " * 15
HEALED = "Prefix caching reuses the blocks of a prompt that an earlier request computed. " * 6
STREAMED = "Speculative decoding drafts several tokens and verifies them in one step. " * 5
LOST = "Tensor parallelism splits every weight matrix across the ranks of a group. " * 5
SLOW = "A router sends each request to a decode pool that batches continuously. " * 6
CRAWLING = "Structured outputs constrain every sampled token to a grammar's language. " * 14
SHORT = "Hello there"
MAX_TOKENS = {STREAMED: 120, LOST: 120}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(MODEL), dtype="float32", num_kv_blocks=256, num_threads=1)


@pytest.fixture(scope="module")
def oracle(llm: LLM) -> dict[str, str]:
    prompts = [IDLE, PUSHING, PUSHED, HEALED, STREAMED, LOST, SLOW, CRAWLING, SHORT]
    outputs = [llm.generate([p], SamplingParams(max_tokens=MAX_TOKENS.get(p, 8), **GREEDY), use_tqdm=False)[0]
               for p in prompts]
    return {p: o.text for p, o in zip(prompts, outputs, strict=True)}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with ray_cluster("f", ROUTER, {PREFILL: {"prefill_node": 1}, **{h: {"decode_node": 1} for h in DECODES}}) as ray:
        path = write_config(tmp_path_factory.mktemp("faults") / "four-hosts.yaml")
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
        for host in DECODES:  # a test that failed with a host lost: it boots again
            if not bed.pids(host):
                deployment.ray.join(host, {"decode_node": 1})
        all_live(deployment, timeout=180)


def all_live(deployment: Deployment, timeout: float = 120.0) -> dict[str, dict]:
    return deployment.wait("every worker live, on its own host", lambda w: len(w) == 3 and all(
        row["live"] and row["stats"] for row in w.values()) and {
        deployment.host_of(w[n]) for n in ("decode-0", "decode-1")} == set(DECODES), timeout)


def complete(deployment: Deployment, prompt: str) -> dict:
    return deployment.call("/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS.get(prompt, 8), **GREEDY})


def decode_totals(stats: dict[str, dict]) -> dict[str, int]:
    """The decode pool's counters (Deployment.stats()), summed over its workers."""
    keys = ("remote", "local", "fallbacks", "kv_bytes_received")
    return {k: sum(stats[n][k] for n in ("decode-0", "decode-1")) for k in keys}


def decode_totals_once(deployment: Deployment, what: str, done: Callable[[dict[str, int]], bool]) -> dict[str, int]:
    """The decode pool's counters once done(totals) holds: a counter may move after an
    answer's stream ends (the KV bytes are counted when the prefill worker's PrefillDone
    comes, on its own connection, while the blocks' arrival is the transport's), and a
    worker in a step may miss an ask of /status."""
    workers = deployment.wait(what, lambda w: done(decode_totals({n: r["stats"] for n, r in w.items()})), timeout=30)
    return decode_totals({n: r["stats"] for n, r in workers.items()})


def host_running_one_request(deployment: Deployment) -> int:
    """The host of the decode worker running the one request in flight."""
    workers = deployment.wait("one decode worker running a request", lambda w: sum(
        w[n]["stats"]["running"] for n in ("decode-0", "decode-1")) == 1, timeout=30)
    return next(deployment.host_of(workers[n]) for n in ("decode-0", "decode-1") if workers[n]["stats"]["running"])


@pytest.mark.timeout(300)
def test_a_partition_between_prefill_and_decode_hosts_idle_and_mid_push(healthy: Deployment,
                                                                         oracle: dict[str, str]) -> None:
    deployment, bed = healthy, healthy.bed
    before = deployment.stats()
    for decode in DECODES:
        bed.partition(PREFILL, decode)
    # Idle: the prompt's RemotePrefill cannot reach the prefill worker.
    start = time.monotonic()
    idle = complete(deployment, IDLE)
    assert idle["choices"][0]["text"] == oracle[IDLE]
    assert DEADLINE_S <= time.monotonic() - start < DEADLINE_S + 30
    # Mid-push. First, at the slowed rate and uncut, a prompt as long is pushed in time.
    for decode in DECODES:
        bed.heal(PREFILL, decode)
        bed.limit(decode, PUSH_RATE)
    # A healed link carries a connection's stalled bytes only when its TCP retransmit
    # timer, backed off through the cut, next fires (seconds later), and the control
    # push's prompt would queue behind the idle one's: wait for that one to arrive (and
    # be refused: past its deadline), so the control is not timed on the backoff.
    deployment.wait("the idle prompt held up by the cut to reach the prefill worker", lambda w: bool(
        w["prefill-0"]["stats"]) and w["prefill-0"]["stats"]["refused"] > before["prefill-0"]["refused"], timeout=60)
    control = complete(deployment, PUSHED)
    assert control["choices"][0]["text"] == oracle[PUSHED]
    base = decode_totals(before)
    # its bytes are counted when the prefill worker's PrefillDone comes, which may follow the answer
    uncut = decode_totals_once(deployment, "the control push's bytes counted", lambda t: t[
        "kv_bytes_received"] > base["kv_bytes_received"])
    assert uncut["remote"] == base["remote"] + 2 and uncut["fallbacks"] == \
        base["fallbacks"] + 1, "an uncut push at this rate did not arrive in time"
    push_bytes = (uncut["kv_bytes_received"] - base["kv_bytes_received"]) / (
        control["usage"]["prompt_tokens"] - 1)  # per prompt token
    # Then cut once a megabyte of the push has passed the bridge toward the decode hosts.
    answer: dict[str, object] = {}

    def request() -> None:
        try:
            answer["r"] = complete(deployment, PUSHING)
        except Exception as e:  # reported below, with the test's own assertion
            answer["error"] = repr(e)

    base = sum(bed.bytes_to(d) for d in DECODES)
    pushing = threading.Thread(target=request)
    pushing.start()
    end = time.monotonic() + 30
    while (passed := sum(bed.bytes_to(d) for d in DECODES) - base) < 1 << 20:
        assert time.monotonic() < end, "the push never started"
        time.sleep(0.01)
    for decode in DECODES:
        bed.partition(PREFILL, decode)
    pushing.join(60)
    assert "r" in answer, answer
    result = answer["r"]
    assert isinstance(result, dict) and result["choices"][0]["text"] == oracle[PUSHING]
    assert passed < 0.8 * push_bytes * (result["usage"]["prompt_tokens"] - 1), "cut after the push, not in it"
    during = decode_totals(deployment.stats())
    assert during["fallbacks"] == uncut["fallbacks"] + 1
    assert during["kv_bytes_received"] == uncut["kv_bytes_received"]  # a cut push's bytes are not KV received
    for decode in DECODES:
        bed.heal(PREFILL, decode)
        bed.limit(decode, None)
    # Healed: what was held up arrives; the late prompt is refused, not computed; the
    # half-pushed prompt's job fails; nothing stays held anywhere.
    prefill = before["prefill-0"]
    workers = deployment.wait("the late prompt refused, the cut push failed, every block free", lambda w: settled(
        w) and (w["prefill-0"]["stats"]["refused"], w["prefill-0"]["stats"]["failed"]) == (
        prefill["refused"] + 1, prefill["failed"] + 1))
    # refused for its deadline: no decode worker restarted (a new session is the other reason)
    assert {n: workers[n]["stats"]["ranks"] for n in ("decode-0", "decode-1")} == {
        n: before[n]["ranks"] for n in ("decode-0", "decode-1")}
    computed = workers["prefill-0"]["stats"]["tokens_computed"] - prefill["tokens_computed"]
    assert computed <= (control["usage"]["prompt_tokens"] - 1) + (result["usage"]["prompt_tokens"] - 1)
    # ... and the prefill worker is used again.
    healed = complete(deployment, HEALED)
    assert healed["choices"][0]["text"] == oracle[HEALED]
    after = decode_totals_once(deployment, "the healed push's bytes counted", lambda t: t[
        "kv_bytes_received"] > during["kv_bytes_received"])
    assert after["remote"] == during["remote"] + 1 and after["fallbacks"] == during["fallbacks"]
    assert settled(deployment.wait("every block free", settled, timeout=30))


@pytest.mark.timeout(300)
def test_a_partition_between_router_and_a_decode_host_fails_over_mid_stream(healthy: Deployment,
                                                                           oracle: dict[str, str]) -> None:
    deployment, bed = healthy, healthy.bed
    cut: list[int] = []

    def cut_its_host(event: int) -> None:
        if event == 2:  # streaming: cut the router off the decode host running it
            cut.append(host_running_one_request(deployment))
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
            lost.append(host_running_one_request(deployment))
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
    settled_rows = deployment.wait("every block free", settled, timeout=30)  # earlier requests all counted
    before = decode_totals({name: row["stats"] for name, row in settled_rows.items()})
    text, _, ttft = deployment.stream({"prompt": SLOW, "max_tokens": 8, **GREEDY})
    assert text == oracle[SLOW] and ttft < DEADLINE_S
    middle = decode_totals_once(deployment, "the push counted", lambda t: t["remote"] == before["remote"] + 1)
    assert middle["fallbacks"] == before["fallbacks"]  # pushed
    # Below router.remote_prefill_min_tokens: prefilled where it decodes, no push to wait for.
    text, _, ttft = deployment.stream({"prompt": SHORT, "max_tokens": 8, **GREEDY})
    assert text == oracle[SHORT] and ttft < DEADLINE_S
    after = decode_totals_once(deployment, "the local prefill counted", lambda t: t["local"] == middle["local"] + 1)
    assert after["remote"] == middle["remote"]
    # Slower than the deadline allows (9 MB at 5 Mbit/s): prefilled here after it.
    for decode in DECODES:
        bed.limit(decode, "5mbit")
    text, _, ttft = deployment.stream({"prompt": CRAWLING, "max_tokens": 8, **GREEDY})
    assert text == oracle[CRAWLING] and DEADLINE_S <= ttft < DEADLINE_S + 30
    decode_totals_once(deployment, "the fallback counted", lambda t: t["fallbacks"] == after["fallbacks"] + 1)


@pytest.mark.timeout(400)
def test_a_random_fault_schedule_costs_no_request_and_no_token(healthy: Deployment, llm: LLM) -> None:
    """tests/fuzz/hosts.py, one seed (`python -m benchmarks.fuzz hosts` runs more)."""
    assert run_hosts_seed(healthy, TextOracle(llm), seed=0) == []
