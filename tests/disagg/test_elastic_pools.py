"""Elastic pools under the local launcher, over real HTTP: scale a 1P1D deployment up
to 2P2D and back down through the admin endpoint while requests stream, and every
request finishes with the colocated engine's greedy tokens (those moved off a drained
decode worker included). Bad scale requests get clear errors and change nothing."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from cluster.cli import main
from cluster.config import ClusterConfig
from cluster.serve import build
from engine import LLM, SamplingParams
from tests.http_server import free_port, serving

ADMIN = "admin-secret-key"
API = "user-key"
PROMPTS = [f"Request {i}: paged attention keeps keys and values in blocks of sixteen tokens. " * 2
           for i in range(6)]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def deployment(llama_dir: Path) -> Iterator[tuple[str, ClusterConfig, object, object]]:
    config = ClusterConfig.from_dict({
        "model": str(llama_dir), "transport": "shm", "prefill_deadline_s": 5.0,
        "router": {"port": free_port(), "remote_prefill_min_tokens": 8, "api_keys": [API], "admin_keys": [ADMIN]},
        "prefill": {"replicas": 1, "engine": {"num_kv_blocks": 96, "max_num_batched_tokens": 64}},
        "decode": {"replicas": 1, "engine": {"num_kv_blocks": 96}}})
    workers, router = build(config)
    try:
        with serving(router, config.router.port) as base:
            yield base, config, workers, router
    finally:
        workers.stop()


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> list[str]:
    llm = LLM(str(llama_dir), num_kv_blocks=96)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def admin(base: str, method: str, path: str, body: object = None, key: str | None = ADMIN) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{base}{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def text_of(base: str, model: str, prompt: str) -> str:
    """A greedy completion's text, and that it ran to max_tokens."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API, timeout=120, max_retries=0)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == MAX_TOKENS
    return out.choices[0].text


@pytest.mark.timeout(400)
def test_scaling_up_and_down_under_load_fails_no_request(deployment, expected) -> None:
    base, config, workers, router = deployment
    assert admin(base, "GET", "/admin/pools")[1]["decode"] == 1
    results: list[tuple[int, str]] = []
    stop = threading.Event()

    def load(first: int) -> None:  # one client's requests, one after another, until stopped
        i = first
        while not stop.is_set():
            results.append((i, text_of(base, config.model, PROMPTS[i % len(PROMPTS)])))
            i += 4

    def until(condition, what: str, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < end, what
            time.sleep(0.02)

    with ThreadPoolExecutor(4) as clients:
        running = [clients.submit(load, i) for i in range(4)]
        try:
            # Up, then down with no time to drain: what decode-1 runs moves by failover
            # (a drain that ends in time: tests/disagg/test_autoscale_serving.py).
            status, up = admin(base, "POST", "/admin/scale", {"prefill": 2, "decode": 2})
            assert status == 200 and sorted(up["added"]) == ["decode-1", "prefill-1"], up
            until(lambda: router.control.requests_on("decode-1") > 0, "decode-1 never took a request")
            router.scaler.drain_timeout_s = 0.0
            status, down = admin(base, "POST", "/admin/scale", {"prefill": 1, "decode": 1})
            assert status == 200 and sorted(down["removed"]) == ["decode-1", "prefill-1"], down
            assert down["moved_requests"] >= 1 and (down["prefill"], down["decode"]) == (1, 1)
        finally:
            stop.set()
            for client in running:
                client.result(timeout=120)
    assert len(results) >= 8
    for i, text in results:
        assert text == expected[i % len(PROMPTS)], f"request {i} differs from the colocated engine"
    pools = admin(base, "GET", "/admin/pools")[1]
    assert [w["name"] for w in pools["workers"]] == ["decode-0", "prefill-0"]
    assert [w.name for w in workers.all] == ["decode-0", "prefill-0"]
    metrics = urllib.request.urlopen(urllib.request.Request(f"{base}/metrics", headers={
        "Authorization": f"Bearer {API}"}), timeout=30).read().decode()
    assert 'pdserve_scale_events_total{action="add",role="decode"} 1.0' in metrics
    assert 'pdserve_scale_events_total{action="remove",role="prefill"} 1.0' in metrics
    assert 'worker="decode-1"' not in metrics  # a worker scaled away leaves /metrics


@pytest.mark.timeout(60)
def test_bad_scale_requests_get_clear_errors_and_change_nothing(deployment) -> None:
    base = deployment[0]
    cases = [
        ({"decode": 0}, 400, "at least 1"),
        ({"decode": 9}, 400, "autoscale.decode.max"),
        ({"prefill": -1}, 400, "integer >= 0"),
        ({"decode": "2"}, 400, "integer >= 0"),
        ({"gpus": 2}, 400, "unknown field 'gpus'"),
        ({}, 400, "at least one pool"),
    ]
    for body, status, words in cases:
        got, answer = admin(base, "POST", "/admin/scale", body)
        assert got == status and words in answer["error"]["message"], (body, got, answer)
    head = urllib.request.Request(f"{base}/admin/pools", headers={"Authorization": f"Bearer {ADMIN}"}, method="HEAD")
    assert urllib.request.urlopen(head, timeout=30).status == 200  # as every GET endpoint
    assert admin(base, "POST", "/admin/scale", {"decode": 2}, key=None)[0] == 401
    assert admin(base, "POST", "/admin/scale", {"decode": 2}, key=API)[0] == 401  # a model key is no admin key
    pools = admin(base, "GET", "/admin/pools")[1]
    assert (pools["prefill"], pools["decode"]) == (1, 1)


@pytest.mark.timeout(60)
def test_pdserve_scale_shows_the_pools_and_says_why_it_refuses(deployment, capsys, monkeypatch) -> None:
    base = deployment[0]
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", ADMIN)
    assert main(["scale", "--url", base]) == 0
    assert capsys.readouterr().out.strip() == "pdserve: prefill 1, decode 1"
    assert main(["scale", "--url", base, "--decode", "9"]) == 2
    assert "9 is beyond autoscale.decode.max (8)" in capsys.readouterr().err
    assert main(["scale", "x", "--url", base]) == 2  # a Ray deployment's name and a router: which?
    assert "give one of them" in capsys.readouterr().err
    assert main(["scale", "gone.yaml", "--url", base]) == 2
    assert "no config file 'gone.yaml'" in capsys.readouterr().err
    assert main(["scale"]) == 2
    assert "name the deployment" in capsys.readouterr().err
    assert main(["scale", "--url", base, "--admin-key", API, "--decode", "2"]) == 1
    assert "refused: Incorrect admin key provided" in capsys.readouterr().err
