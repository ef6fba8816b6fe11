"""SLO-aware admission over real HTTP, against fake decode workers whose stats replies
report step times (tests/unit/test_router_fanout.py FanoutWorker): a request predicted
to miss its target is a 429 naming it (reject), or goes at the lowest priority
(best_effort); targets come from the body, the headers and the key's defaults; the
router picks the worker with the most headroom; fair queuing tags a flooding key's
requests behind a quiet key's; /status and /metrics say what happened."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.config import ClusterConfig
from cluster.serve import router_for
from cluster.status import format_status
from router.admission import LOWEST_PRIORITY
from router.app import Router
from router.predictor import step_seconds
from tests.http_server import free_port, serving
from tests.unit.test_router_fanout import FanoutWorker
from tests.unit.test_router_http import open_request, wait_for
from tests.unit.test_slo_admission import step_times

KEYS = ["sk-quiet-0123456789", "sk-flood-0123456789"]


def figures(step_s: float, prefill_tokens_per_s: float = 1000.0) -> dict[str, Any]:
    """Stats fields of a worker whose steps take step_s at batch 1 and 1.5x at batch 4,
    and whose prefills run at prefill_tokens_per_s."""
    return {"step_seconds_by_requests": step_times([(1, step_s), (4, step_s * 1.5)]),
            "step_seconds_by_tokens": step_times([(1000, 1000 / prefill_tokens_per_s)])}


@pytest.fixture
def deployment(llama_dir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, Router, list[FanoutWorker]]]:
    """The router over two fake decode workers (the fast one second, so that only the
    prediction sends a request there); request.param: the router section's extras."""
    workers = [FanoutWorker(), FanoutWorker()]
    workers[0].stats = figures(0.2)
    workers[1].stats = figures(0.02)
    router_section = {"health_interval_s": 0.1, "worker_timeout_s": 0.6, "policy": "round_robin",
                      **getattr(request, "param", {})}
    config = ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0}, "router": router_section})
    router = router_for(config, {"decode-0": workers[0].address, "decode-1": workers[1].address})
    try:
        with serving(router, free_port()) as base:
            # Figures in: both workers' stats replies have reached the predictor.
            wait_for(lambda: len(router.placement.predictor.stats) == 2, 10, "both workers' figures")
            yield base, router, workers
    finally:
        for w in workers:
            w.close()


def post(base: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, dict, Any]:
    response = open_request(base, "POST", "/v1/completions", {"prompt": "Hello there", "max_tokens": 2, **body},
                            timeout=20, headers=headers)
    return response.status, json.loads(response.read()), response.headers


REJECT = {"slo": {"policy": "reject"}}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deployment", [REJECT], indirect=True)
def test_a_request_no_worker_can_serve_in_time_is_a_429_naming_its_target(deployment) -> None:
    base, router, workers = deployment
    status, body, headers = post(base, {"slo_ttft_ms": 1})
    assert status == 429, body
    error = body["error"]
    assert error["code"] == "slo_unattainable" and error["param"] == "slo_ttft_ms" and error["type"] == "rate_limit_error"
    assert "slo_ttft_ms 1" in error["message"] and int(headers["Retry-After"]) >= 1
    status, body, _ = post(base, {}, headers={"x-slo-tpot-ms": "5"})  # the fast worker's 20 ms steps miss it too
    assert status == 429 and body["error"]["param"] == "slo_tpot_ms"
    assert not workers[0].messages("generate") and not workers[1].messages("generate")  # nothing reached a worker
    status, body, _ = post(base, {"slo_ttft_ms": 100_000, "slo_tpot_ms": 50})  # only the fast worker meets it
    assert status == 200, body
    assert len(workers[1].messages("generate")) == 1 and not workers[0].messages("generate")
    metrics = router.metrics.render().decode()
    assert 'pdserve_slo_admissions_total{decision="rejected",reason="ttft"} 1.0' in metrics
    assert 'pdserve_slo_admissions_total{decision="rejected",reason="tpot"} 1.0' in metrics
    assert 'pdserve_slo_admissions_total{decision="admitted",reason="met"} 1.0' in metrics
    assert 'pdserve_slo_requests_total{key="none",outcome="met"} 1.0' in metrics
    assert 'pdserve_slo_prediction_error_seconds_count{prefill="local",target="ttft"} 1.0' in metrics


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deployment", [{"slo": {"policy": "best_effort", "ttft_ms": 1}}], indirect=True)
def test_best_effort_admits_at_the_lowest_priority_under_the_deployments_default(deployment) -> None:
    base, router, workers = deployment
    status, body, _ = post(base, {"priority": -3})
    assert status == 200, body
    (generate,) = workers[0].messages("generate") + workers[1].messages("generate")
    assert generate.priority == LOWEST_PRIORITY
    status, _, _ = post(base, {"priority": -3, "slo_ttft_ms": 100_000})  # its own target beats the default
    assert status == 200
    second = (workers[0].messages("generate") + workers[1].messages("generate"))[-1]
    assert second.priority == -3
    assert b'pdserve_slo_admissions_total{decision="degraded",reason="ttft"} 1.0' in router.metrics.render()
    assert b'outcome="missed"' in router.metrics.render()  # the degraded one missed its 1 ms


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deployment", [{"slo": {"policy": "off"}}], indirect=True)
def test_policy_off_admits_all_but_still_measures_its_predictions(deployment) -> None:
    base, router, _ = deployment
    for _ in range(3):
        assert post(base, {"slo_ttft_ms": 1})[0] == 200
    response = open_request(base, "GET", "/status", None, timeout=10)
    status = json.loads(response.read())
    assert status["slo"]["policy"] == "off"
    ttft = status["slo"]["prediction_error"]["ttft"]
    assert ttft["n"] == 3 and ttft["p50_s"] is not None and ttft["p90_s"] >= ttft["p50_s"]
    newest = router.placement.predictor.errors["ttft"][-1]
    last = json.loads(open_request(base, "GET", "/status?prediction_window=1", None, timeout=10).read())
    assert last["slo"]["prediction_error"]["ttft"] == {"n": 1.0, "p50_s": newest, "p90_s": newest}
    for bad in ("0", "1001", "-1", "x", "1.5", "%C2%B2", "%EF%BC%91", "9" * 5000):  # ², fullwidth 1
        refused = open_request(base, "GET", f"/status?prediction_window={bad}", None, timeout=10)
        assert refused.status == 400 and "prediction_window" in refused.read().decode()
    assert "slo policy off; tpot error" in format_status(status) and "ttft error p50" in format_status(status)
    assert b'pdserve_slo_requests_total{key="none",outcome="missed"} 3.0' in router.metrics.render()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deployment", [{"slo": {"policy": "reject", "key_defaults": [{"ttft_ms": 1}, None]},
                                         "api_keys": KEYS, "key_weights": [1, 1], "worker_timeout_s": 30}],
                         indirect=True)
def test_key_defaults_apply_per_key_and_a_flooding_key_is_tagged_behind_a_quiet_one(deployment) -> None:
    base, router, workers = deployment
    quiet, flood = ({"Authorization": f"Bearer {k}"} for k in KEYS)
    status, body, _ = post(base, {}, quiet)
    assert status == 429 and body["error"]["param"] == "slo_ttft_ms"  # key 0's default: 1 ms (and it costs nothing)
    for w in workers:
        w.hold.set()  # nothing gets a token: every request stays queued
    responses = [open_request(base, "POST", "/v1/completions", {"prompt": "Hello there", "max_tokens": 2,
                                                                 "stream": True}, 20, flood) for _ in range(4)]
    assert all(r.status == 200 for r in responses)
    responses.append(open_request(base, "POST", "/v1/completions", {"prompt": "Hello there", "max_tokens": 3,
                                                                     "slo_ttft_ms": 100_000, "stream": True},
                                  20, quiet))
    assert responses[-1].status == 200
    # A streamed 200 may come before its Generate reaches the worker: wait for all five.
    wait_for(lambda: sum(len(w.messages("generate")) for w in workers) == 5, 10, "five generates")
    generates = [m for w in workers for m in w.messages("generate")]
    flood_tags = sorted(g.queue_tag for g in generates if g.params.max_tokens == 2)
    (quiet_tag,) = [g.queue_tag for g in generates if g.params.max_tokens == 3]
    # The flood's tags step by its cost (prompt tokens + 1); the quiet key's first request
    # starts at the virtual time, the head of the queue: it is served second, not fifth.
    cost = len(generates[0].prompt) + 1
    assert flood_tags == [0.0, cost, 2 * cost, 3 * cost] and quiet_tag == 0.0
    for w in workers:
        w.hold.clear()
    for r in responses:
        r.read()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deployment", [{"slo": {"policy": "reject"}, "api_keys": KEYS, "key_weights": [1, 1]}],
                         indirect=True)
def test_a_batch_whose_second_prompt_would_miss_is_refused_whole_and_costs_nothing(deployment) -> None:
    base, router, workers = deployment
    workers[0].stats = figures(60.0)  # out of the running: only the fast worker can meet a target
    wait_for(lambda: step_seconds(router.placement.predictor.stats[("decode", "decode-0")].step_seconds_by_requests, 1)
             == 60.0, 10, "the slow worker's new figures")
    key = {"Authorization": f"Bearer {KEYS[0]}"}
    prompt = " ".join(["hello"] * 100)
    tokens = len(router.tokenizer.encode(prompt))
    # On the fast worker (1000 tokens/s, 20 ms steps) the first prompt's first token comes
    # in tokens ms + 20; the second, queued behind it, in 2 x tokens + 23: a target between
    # the two admits one prompt, not both.
    target = tokens + 20 + (tokens + 3) / 2
    fair = router.placement.fair
    before = fair.start(0)
    response = open_request(base, "POST", "/v1/completions", {"prompt": [prompt, prompt], "max_tokens": 2,
                                                               "slo_ttft_ms": target}, 20, key)
    body = json.loads(response.read())
    assert response.status == 429 and body["error"]["param"] == "slo_ttft_ms"  # the first fits, the second queues behind it
    assert not workers[0].messages("generate") and not workers[1].messages("generate")  # nothing was sent
    assert not router.placement.predictor.tickets and fair.start(0) == before  # nothing held, nothing charged
    metrics = router.metrics.render().decode()
    assert 'decision="rejected",reason="ttft"} 1.0' in metrics and 'decision="admitted"' not in metrics
    status, body, _ = post(base, {"prompt": [prompt], "slo_ttft_ms": target}, key)  # one alone fits
    assert status == 200, body


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deployment", [{"slo": {"policy": "reject"}}], indirect=True)
def test_a_request_of_one_token_has_no_tpot_to_miss(deployment) -> None:
    base, _, _ = deployment
    status, body, _ = post(base, {"max_tokens": 2, "slo_tpot_ms": 0.001})
    assert status == 429 and body["error"]["param"] == "slo_tpot_ms"
    assert post(base, {"max_tokens": 1, "slo_tpot_ms": 0.001})[0] == 200
    assert post(base, {"max_tokens": 1}, {"x-slo-tpot-ms": "0.001"})[0] == 200
