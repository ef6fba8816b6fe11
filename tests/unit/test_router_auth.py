"""API keys at the router's HTTP endpoints: `Authorization: Bearer <key>` or a 401 in
OpenAI's shape (code invalid_api_key) with WWW-Authenticate; /health always open,
/metrics as configured; no key in /status or in any log line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cluster.config import ClusterConfig
from cluster.serve import router_for
from router.app import create_app
from router.auth import KeyRing
from router.errors import APIError

KEYS = ["sk-first-0123456789", "sk-second-0123456789"]


def app_with(llama_dir: Path, **router: object) -> TestClient:
    config = ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0}, "router": router})
    # A worker address nobody listens on: these requests never reach a worker.
    return TestClient(create_app(router_for(config, {"decode-0": "tcp://127.0.0.1:9"})))


@pytest.fixture(scope="module")
def http(llama_dir: Path):
    with app_with(llama_dir, api_keys=KEYS) as client:
        yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers,message,challenge", [
    ({}, "You didn't provide an API key", 'Bearer realm="pdserve"'),
    ({"Authorization": "Basic c2stZmlyc3Q6"}, "must be 'Bearer YOUR_KEY'", 'error="invalid_request"'),
    ({"Authorization": "Bearer"}, "must be 'Bearer YOUR_KEY'", 'error="invalid_request"'),
    ({"Authorization": "Bearer   "}, "must be 'Bearer YOUR_KEY'", 'error="invalid_request"'),
    ({"Authorization": "sk-first-0123456789"}, "must be 'Bearer YOUR_KEY'", 'error="invalid_request"'),
    (bearer("sk-wrong"), "Incorrect API key provided", 'error="invalid_token"'),
    (bearer(KEYS[0][:-1]), "Incorrect API key provided", 'error="invalid_token"'),
    (bearer(KEYS[0] + "x"), "Incorrect API key provided", 'error="invalid_token"'),
])
@pytest.mark.parametrize("method,path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                         ("GET", "/v1/models"), ("GET", "/status"), ("GET", "/metrics"),
                                         ("GET", "/openapi.json"), ("GET", "/no/such/path")])
def test_anything_but_a_configured_key_is_a_401(http, headers: dict, message: str, challenge: str,
                                                method: str, path: str) -> None:
    r = http.request(method, path, headers=headers, json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error", error
    assert message in error["message"] and KEYS[0] not in r.text
    assert r.headers["www-authenticate"].startswith('Bearer realm="pdserve"') and challenge in r.headers["www-authenticate"]


def test_two_authorization_headers_are_a_401_whichever_comes_last(http) -> None:
    """One proxy in front may read the first header and the server the last: several are
    refused rather than guessed at."""
    for pair in ([("authorization", "Bearer sk-wrong"), ("authorization", f"Bearer {KEYS[0]}")],
                 [("authorization", f"Bearer {KEYS[0]}"), ("authorization", f"Bearer {KEYS[1]}")]):
        r = http.get("/v1/models", headers=pair)
        assert r.status_code == 401 and "Send one Authorization header" in r.json()["error"]["message"], r.text


def test_each_configured_key_passes(http) -> None:
    for key in KEYS:
        r = http.get("/v1/models", headers=bearer(key))
        assert r.status_code == 200 and r.json()["data"][0]["object"] == "model"
        assert http.get("/v1/models", headers={"Authorization": f"bearer   {key}  "}).status_code == 200
    # Past the key, the request is checked as ever: a bad body is a 400, not a 401.
    r = http.post("/v1/completions", headers=bearer(KEYS[1]), json={"prompt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_health_is_open_and_status_needs_a_key_but_never_shows_one(http, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    assert http.get("/health").status_code == 200
    assert http.get("/status").status_code == 401
    r = http.get("/status", headers=bearer(KEYS[0]))
    assert r.status_code == 200 and "decode_workers" in r.json()
    assert all(key not in r.text for key in KEYS)
    http.get("/status", headers=bearer("sk-not-a-key-987654"))
    assert all(key not in caplog.text for key in [*KEYS, "sk-not-a-key-987654"])


def test_metrics_need_a_key_unless_configured_open(llama_dir: Path) -> None:
    with app_with(llama_dir, api_keys=KEYS) as http:
        assert http.get("/metrics").status_code == 401
        r = http.get("/metrics", headers=bearer(KEYS[0]))
        assert r.status_code == 200 and "pdserve_" in r.text
        assert 'pdserve_requests_rejected_total{status="401"} 1.0' in r.text  # the guard's own answers count
    with app_with(llama_dir, api_keys=KEYS, metrics_need_key=False) as http:
        assert http.get("/metrics").status_code == 200
        assert http.get("/status").status_code == 401


def test_without_keys_nothing_needs_one(llama_dir: Path) -> None:
    with app_with(llama_dir) as http:
        assert http.get("/status").status_code == 200 and http.get("/metrics").status_code == 200
        assert http.get("/v1/models", headers=bearer("anything")).status_code == 200


def test_key_ring_names_the_key_by_its_position() -> None:
    ring = KeyRing(KEYS)
    assert ring.identify(f"Bearer {KEYS[1]}".encode()) == 1 and ring.identify(f"Bearer {KEYS[0]}".encode()) == 0
    for header in (None, b"Bearer sk-nope", b"Bearer \xff\xfe", b"Token " + KEYS[0].encode()):
        with pytest.raises(APIError) as err:
            ring.identify(header)
        assert err.value.status == 401 and err.value.code == "invalid_api_key"
    assert "_digests" in vars(ring) and all(len(d) == 32 for d in vars(ring)["_digests"])  # hashes, not keys
    assert all(KEYS[0] not in repr(v) for v in vars(ring).values())


def test_the_admin_key_ring_says_admin_key_in_its_errors() -> None:
    """/admin/* asks for an admin key (router.admin_keys): its 401s must not send the
    operator looking for an API key."""
    ring = KeyRing(["adm-secret"], kind="admin key")
    for header, words in ((None, "You didn't provide an admin key"), (b"Bearer nope", "Incorrect admin key")):
        with pytest.raises(APIError) as err:
            ring.identify(header)
        assert err.value.status == 401 and words in str(err.value)
    assert ring.identify(b"Bearer adm-secret") == 0
