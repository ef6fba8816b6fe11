"""Per-key limits: requests per second (a token bucket) and tokens in flight, each a 429
with a computed Retry-After; per key, or for all callers as one without keys."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest

from cluster.config import ClusterConfig
from cluster.serve import router_for
from router.errors import APIError
from router.limits import Limits, TokenBucket
from tests.http_server import free_port, serving
from tests.unit.test_router_http import FakeDecodeWorker, request, wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def limits(rate: float | None = None, burst: int | None = None, tokens: int | None = None) -> tuple[Limits, Clock]:
    clock = Clock()
    settings = SimpleNamespace(key_requests_per_s=rate, key_burst=burst, key_tokens_in_flight=tokens)
    return Limits(settings, clock), clock


def refused(call, *args) -> APIError:
    with pytest.raises(APIError) as err:
        call(*args)
    return err.value


def test_a_bucket_lets_a_burst_through_then_one_request_per_refill() -> None:
    bucket = TokenBucket(rate=2.0, burst=3, tokens=3, stamp=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.5)  # a request every 1/rate s
    assert bucket.take(0.25) == pytest.approx(0.25)
    assert bucket.take(0.5) == 0.0
    assert [bucket.take(100.0) for _ in range(4)][-1] > 0  # idle for long: still only `burst` at once


def test_requests_per_second_are_per_key_with_a_computed_retry_after() -> None:
    lim, clock = limits(rate=0.25, burst=2)
    lim.admit(0)
    lim.admit(0)
    err = refused(lim.admit, 0)
    assert err.status == 429 and err.kind == "rate_limit_error" and err.retry_after == 4  # 1 / 0.25 s
    assert "0.25 requests per second (burst 2)" in err.message
    lim.admit(1)  # another key has its own bucket
    clock.now += 2.5
    assert refused(lim.admit, 0).retry_after == 2  # ceil(1.5 s)
    clock.now += 1.5
    lim.admit(0)


def test_the_default_burst_is_one_second_of_requests() -> None:
    lim, _ = limits(rate=2.5)
    for _ in range(3):
        lim.admit(None)
    assert refused(lim.admit, None).retry_after == 1


def test_tokens_in_flight_are_held_until_released() -> None:
    lim, clock = limits(tokens=100)
    a = lim.lease(0, 30, 30)
    b = lim.lease(0, 10, 10)
    assert lim.in_flight(0) == 80
    err = refused(lim.lease, 0, 10, 20)
    assert err.status == 429 and "80 tokens in flight" in err.message and "limit of 100" in err.message
    assert err.retry_after == 1  # neither running request has a pace yet
    lim.lease(1, 50, 50)  # another key
    lim.release(b)
    lim.release(b)  # idempotent
    c = lim.lease(0, 10, 20)
    assert lim.in_flight(0) == 90
    lim.release(a)
    lim.release(c)
    assert lim.in_flight(0) == 0


def test_retry_after_is_when_the_soonest_requests_free_enough_at_their_pace() -> None:
    lim, clock = limits(tokens=100)
    slow = lim.lease(0, 10, 40)  # 50 tokens
    fast = lim.lease(0, 10, 40)  # 50 tokens
    clock.now += 2.0
    slow.progress(4)  # 2 tokens/s: 36 left = 18 s
    fast.progress(20)  # 10 tokens/s: 20 left = 2 s
    assert refused(lim.lease, 0, 10, 30).retry_after == 2  # fast's 50 are enough
    assert refused(lim.lease, 0, 10, 80).retry_after == 18  # needs both
    fast.progress(40)
    slow.progress(40)
    assert refused(lim.lease, 0, 10, 80).retry_after == 1  # at least 1 s


def test_a_request_alone_over_the_limit_is_a_400_naming_max_tokens() -> None:
    lim, _ = limits(tokens=100)
    err = refused(lim.lease, None, 60, 41)
    assert err.status == 400 and err.param == "max_tokens" and "= 101 is more than" in err.message


def test_limits_are_off_by_default() -> None:
    lim, _ = limits()
    for _ in range(1000):
        lim.admit(None)
        lim.lease(None, 10**6, 10**6)


def serve(llama_dir: Path, fake: FakeDecodeWorker, **router: object):
    config = ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0}, "router": router})
    return serving(router_for(config, {"decode-0": fake.address}), free_port())


@pytest.fixture
def fake() -> Iterator[FakeDecodeWorker]:
    worker = FakeDecodeWorker(step_s=0.05)
    yield worker
    worker.close()


def send(base: str, key: str | None, body: dict) -> http.client.HTTPResponse:
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=20)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    return conn.getresponse()


@pytest.mark.timeout(60)
def test_tokens_in_flight_over_http(llama_dir: Path, fake: FakeDecodeWorker) -> None:
    with serve(llama_dir, fake, api_keys=["sk-a", "sk-b"], key_tokens_in_flight=60) as base:
        # A stream of about 45 tokens (prompt + max_tokens) holds them until it ends (2 s).
        stream = send(base, "sk-a", {"prompt": "Hello", "max_tokens": 40, "stream": True})
        assert stream.status == 200
        stream.readline()
        r = send(base, "sk-a", {"prompt": "Hello", "max_tokens": 20})
        body = json.loads(r.read())
        assert r.status == 429 and body["error"]["type"] == "rate_limit_error", body
        assert "tokens in flight" in body["error"]["message"] and 1 <= int(r.headers["Retry-After"]) <= 60
        r = send(base, "sk-b", {"prompt": "Hello", "max_tokens": 20})  # another key is not held back
        assert r.status == 200, r.read()
        r.read()
        stream.read()  # to its end: its tokens are released
        r = send(base, "sk-a", {"prompt": "Hello", "max_tokens": 20})
        assert r.status == 200, r.read()
        r.read()
        r = send(base, "sk-a", {"prompt": "Hello", "max_tokens": 60})  # alone over the limit
        assert r.status == 400 and json.loads(r.read())["error"]["param"] == "max_tokens"


@pytest.mark.timeout(60)
def test_requests_per_second_over_http(llama_dir: Path, fake: FakeDecodeWorker) -> None:
    with serve(llama_dir, fake, api_keys=["sk-a", "sk-b"], key_requests_per_s=1, key_burst=3) as base:
        for _ in range(3):  # refused at parsing, but counted: the rate is checked first
            r = send(base, "sk-a", {"prompt": ""})
            assert r.status == 400
            r.read()
        r = send(base, "sk-a", {"prompt": "Hello", "max_tokens": 2})
        body = json.loads(r.read())
        assert r.status == 429 and "over its rate of 1 requests per second (burst 3)" in body["error"]["message"]
        assert r.headers["Retry-After"] == "1"
        r = send(base, "sk-b", {"prompt": "Hello", "max_tokens": 2})
        assert r.status == 200, r.read()


@pytest.mark.timeout(60)
def test_without_keys_all_callers_are_one_and_a_client_that_hangs_up_frees_its_tokens(
        llama_dir: Path, fake: FakeDecodeWorker) -> None:
    with serve(llama_dir, fake, key_tokens_in_flight=1100) as base:
        with pytest.raises(TimeoutError):  # 1000 tokens take the fake 50 s; give up after 0.5 s
            request(base, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 1000}, timeout=0.5)
        wait_for(lambda: fake.messages("abort"), 5, "the router aborts the request of a client that went away")
        fake.per_step = 20
        status, out = request(base, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 200})
        assert status == 200, out  # 1000 + 200 would be over: the first one's tokens were freed
        stream = send(base, None, {"prompt": "Hello", "max_tokens": 1000, "stream": True})
        stream.readline()
        r = send(base, "any-key-is-ignored", {"prompt": "Hello", "max_tokens": 200})
        assert r.status == 429, r.read()
        stream.close()
