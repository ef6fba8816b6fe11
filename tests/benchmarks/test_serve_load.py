"""benchmarks/serve.py's load modes and its scrape of the router's metrics, without a
server: the closed loop keeps exactly N requests outstanding, a request count stops
either loop, seeds give the same requests, and the KV transfer time is the difference
of two scrapes of the router's real histogram."""

from __future__ import annotations

import asyncio
import math

import pytest

from benchmarks.serve import parse_args
from benchmarks.serving import load
from benchmarks.serving.load import Result, Workload, run_concurrency, run_poisson
from benchmarks.serving.metrics_scrape import KV_HOP, parse_histogram, transfer_delta
from router.metrics import RouterMetrics


def test_draw_is_seeded_and_stops_at_a_count() -> None:
    w = Workload(prompt_tokens=(5, 9), output_len=(2, 4), token_ids=(10, 20))
    a, b = w.draw(50, seed=3, rate=2.0), w.draw(50, seed=3, rate=2.0)
    assert len(a) == 50 and [(t, p) for t, p, _ in a] == [(t, p) for t, p, _ in b]
    assert all(isinstance(p, list) and 5 <= len(p) <= 9 and all(10 <= t < 20 for t in p) for _, p, _ in a)
    assert all(r.prompt_words == len(p) and 2 <= r.output_tokens <= 4 for _, p, r in a)
    assert a[-1][0] > 10  # 50 arrivals at 2/s: past any 10 s duration, the count decides
    assert [p for _, p, _ in w.draw(50, seed=4, rate=2.0)] != [p for _, p, _ in a]
    by_time = Workload(prompt_len=(1, 2)).draw(None, seed=0, rate=10.0, duration=3.0)
    assert 10 < len(by_time) < 60 and all(t <= 3.0 for t, _, _ in by_time)
    closed = Workload(prompt_len=(1, 2)).draw(7, seed=0)
    assert len(closed) == 7 and {t for t, _, _ in closed} == {0.0}


def _fake_server(monkeypatch: pytest.MonkeyPatch, seconds: float) -> dict:
    state = {"now": 0, "max": 0, "order": []}

    async def fake_request(client, url, model, prompt, result: Result, extra=None) -> None:
        state["now"] += 1
        state["max"] = max(state["max"], state["now"])
        state["order"].append(prompt)
        await asyncio.sleep(seconds)
        state["now"] -= 1
        result.ok = True

    monkeypatch.setattr(load, "one_request", fake_request)
    return state


def test_closed_loop_keeps_n_outstanding_until_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _fake_server(monkeypatch, 0.02)
    schedule = Workload(prompt_len=(1, 3)).draw(23, seed=1)
    results, elapsed = asyncio.run(run_concurrency("http://x/v1", "m", schedule, 4, "t"))
    assert state["max"] == 4 and len(results) == 23 and all(r.ok for r in results)
    assert state["order"] == [p for _, p, _ in schedule]  # sent in the schedule's order
    assert elapsed >= 0.02 * 23 / 4


def test_open_loop_sends_at_arrival_times_whatever_is_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _fake_server(monkeypatch, 0.3)
    schedule = Workload(prompt_len=(1, 3)).draw(10, seed=2, rate=100.0)
    results, elapsed = asyncio.run(run_poisson("http://x/v1", "m", schedule, "t"))
    assert state["max"] >= 8 and len(results) == 10 and all(r.ok for r in results)


def test_transfer_time_is_the_difference_of_two_scrapes() -> None:
    metrics = RouterMetrics()
    metrics.observe_phases({"queue": 0.001, "prefill": 0.5, "transfer": 0.007, "decode": 1.0})
    metrics.observe_phases({"queue": 0.001, "prefill": 0.2, "decode": 1.0})  # local: no transfer
    before = metrics.render().decode()
    for seconds in (0.02, 0.02, 0.03, 0.2):
        metrics.observe_phases({"prefill": 0.5, "transfer": seconds + 0.5, "decode": 1.0, "kv_write": seconds})
    after = metrics.render().decode()
    assert parse_histogram(before, "pdserve_request_phase_seconds", {"phase": "transfer"}).count == 1
    assert transfer_delta(before, after, KV_HOP)["mean"] == pytest.approx(0.5675)  # the whole hop
    got = transfer_delta(before, after)  # the KV writes' own time
    assert got["count"] == 4 and got["mean"] == pytest.approx(0.0675)
    # Buckets (0.01, 0.025], (0.025, 0.05], (0.1, 0.25]: the median lies in the first,
    # interpolated as Prometheus does; p99 in the last.
    assert 0.01 < got["p50"] <= 0.025 and 0.1 < got["p99"] <= 0.25
    assert transfer_delta(None, after) is None
    assert math.isnan(transfer_delta(after, after)["mean"])


def test_arguments() -> None:
    args = parse_args(["--url", "http://x/v1", "--concurrency", "2,8", "--num-requests", "200",
                       "--seeds", "0,1,2", "--prompt-tokens", "1500", "2500"])
    assert args.seeds == [0, 1, 2] and args.prompt_tokens == [1500, 2500]
    assert parse_args(["--url", "u", "--seed", "2"]).seeds == [2]
    assert parse_args(["--url", "u"]).rates == "0.5,1" and parse_args(["--url", "u"]).concurrency is None
    both = parse_args(["--url", "u", "--rates", "0.2", "--concurrency", "1", "--num-requests", "5"])
    assert (both.rates, both.concurrency) == ("0.2", "1")  # P5's closed loop and P6's rate, one command
    assert parse_args(["--url", "u", "--concurrency", "1", "--num-requests", "5"]).rates is None
    for bad in (["--concurrency", "4"], ["--prompt-tokens", "9", "3"], ["--num-requests", "0"],
                ["--rates", "1", "--concurrency", "2"]):
        with pytest.raises(SystemExit):
            parse_args(["--url", "u", *bad])


def test_a_sub_millisecond_kv_transfer_reads_as_such() -> None:
    """A KV write on one GPU takes well under 5 ms: the quantiles must not be an artifact
    of a coarse first bucket (they were 2.5 / 4.95 ms whatever the time)."""
    metrics = RouterMetrics()
    before = metrics.render().decode()
    for _ in range(100):
        metrics.observe_phases({"prefill": 0.5, "transfer": 0.002, "decode": 1.0, "kv_write": 0.0008})
    got = transfer_delta(before, metrics.render().decode())
    assert 0.0005 < got["p50"] <= 0.001 and 0.0005 < got["p99"] <= 0.001
