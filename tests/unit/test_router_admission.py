"""Admission and input errors at the router, answered before any worker is involved."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cluster.config import ClusterConfig
from router.app import Router, create_app


@pytest.fixture
def http(llama_dir: Path):
    config = ClusterConfig.from_dict({"model": str(llama_dir), "router": {"max_queued_requests": 2},
                                      "prefill": {"replicas": 0}})
    # A worker address nobody listens on: these requests never reach a worker.
    router = Router(config, {"decode-0": "tcp://127.0.0.1:9"})
    with TestClient(create_app(router)) as client:
        yield client, router


def test_a_full_router_answers_429_with_retry_after(http) -> None:
    client, router = http
    router.in_flight = 2  # as if two requests were being served
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert "max_queued_requests" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,message", [
    (b"{not json", "request body is not valid JSON"),
    (b"[1, 2]", "request body must be a JSON object"),
    (b'{"prompt": ""}', "prompt must not be empty"),
    (b'{"prompt": 5}', "prompt must be a non-empty string or a list of token ids"),
    (b'{"prompt": "hi", "n": 2}', "only n=1 is supported"),
    (b'{"prompt": "hi", "top_p": 0}', "top_p must be in (0, 1]"),
])
def test_malformed_requests_get_400_naming_the_problem(http, body: bytes, message: str) -> None:
    client, _ = http
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_chat_messages_are_checked(http) -> None:
    client, _ = http
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert r.status_code == 400 and "messages must be a non-empty list" in r.json()["error"]["message"]


def test_no_live_decode_worker_answers_503(http) -> None:
    client, router = http
    router.workers[0].health.alive = False  # as if it had been silent past worker_timeout_s
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 503 and "no decode worker is alive" in r.json()["error"]["message"]
