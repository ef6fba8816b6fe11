"""benchmarks/serving/serve.py's load modes and its scrape of the router's metrics, without a
server: the closed loop keeps exactly N requests outstanding, a request count stops
either loop, seeds give the same requests, and the KV transfer time is the difference
of two scrapes of the router's real histogram."""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import json
import math
import threading

import pytest

from benchmarks.serving import load, serve
from benchmarks.serving.load import Result, Workload, run_concurrency, run_poisson
from benchmarks.serving.metrics_scrape import KV_HOP, parse_histogram, transfer_delta
from benchmarks.serving.report import json_text, line, summarize
from benchmarks.serving.serve import parse_args
from benchmarks.serving.server import ServerError, server_model
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


def test_a_stream_that_ends_in_the_routers_error_event_is_a_failed_request() -> None:
    body = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"error": {"message": "no decode worker is alive"}}\n\n'
    result = Result(prompt_words=3, output_tokens=8)

    async def send() -> None:
        transport = load.httpx.MockTransport(lambda request: load.httpx.Response(200, content=body))
        async with load.httpx.AsyncClient(transport=transport) as client:
            await load.one_request(client, "http://x/v1", "m", [1, 2, 3], result)

    asyncio.run(send())
    assert not result.ok and result.error == "stream error: no decode worker is alive"


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


@pytest.mark.parametrize("bad, message", [
    (["--concurrency", "0", "--num-requests", "2"], "--concurrency: 0 must be > 0"),
    (["--concurrency", "-1", "--num-requests", "2"], "--concurrency: -1 must be > 0"),
    (["--concurrency", "x", "--num-requests", "2"], "--concurrency: 'x' in 'x' is not a whole number"),
    (["--concurrency", "2,2", "--num-requests", "2"], "--concurrency: 2 is given twice in '2,2'"),
    (["--rates", "0"], "--rates: 0 must be > 0"),
    (["--rates", "-1"], "--rates: -1 must be > 0"),
    (["--rates", "1,x"], "--rates: 'x' in '1,x' is not a number"),
    (["--rates", "inf"], "--rates: inf is not a finite number"),
    (["--output-len", "5", "2"], "--output-len needs 1 <= MIN <= MAX, got 5 2"),
    (["--output-len", "0", "2"], "--output-len needs 1 <= MIN <= MAX, got 0 2"),
    (["--prompt-len", "5", "2"], "--prompt-len needs 1 <= MIN <= MAX, got 5 2"),
    (["--prompt-tokens", "9", "3"], "--prompt-tokens needs 1 <= MIN <= MAX, got 9 3"),
    (["--seeds", "1,,2"], "--seeds: '1,,2' has an empty item"),
    (["--seeds", "0,0"], "--seeds: 0 is given twice in '0,0'"),
    (["--duration", "0"], "--duration must be a number of seconds > 0, got 0.0"),
    (["--duration", "-5"], "--duration must be a number of seconds > 0, got -5.0"),
    (["--num-requests", "0"], "--num-requests must be >= 1, got 0"),
    (["--shared-prefix", "-1"], "--shared-prefix must be >= 0, got -1"),
])
def test_a_bad_argument_is_an_error_naming_it(bad: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--url", "u", *bad])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"serve.py: error: {message}"


def test_arguments_at_their_limits_are_taken() -> None:
    args = parse_args(["--url", "u", "--rates", "0.05,1", "--output-len", "1", "1", "--prompt-len", "0", "0",
                       "--shared-prefix", "20", "--seeds", "3,1", "--duration", "0.5"])
    assert args.seeds == [3, 1] and args.output_len == [1, 1] and args.prompt_len == [0, 0]


class _Server(http.server.BaseHTTPRequestHandler):
    """A server that wants a key: 401 on everything, and it notes every path asked."""
    paths: list[str] = []

    def do_GET(self) -> None:
        self.paths.append(self.path)
        self.send_response(401)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_POST = do_GET

    def log_message(self, *args) -> None:
        pass


def test_a_server_that_wants_a_key_or_is_not_there_is_one_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
        for argv in (["--concurrency", "1", "--num-requests", "2"], ["--model", "m", "--rates", "1"]):
            with pytest.raises(SystemExit) as exc:
                serve.main(["--url", url, *argv])
            assert exc.value.code == f"serve.py: error: the server at {url} needs an API key: set PDSERVE_API_KEY"
        assert set(_Server.paths) == {"/v1/models"}  # nothing else sent
        with pytest.raises(ServerError, match="refuses the key in PDSERVE_API_KEY \\(HTTP 401\\)"):
            server_model(url, "sk-wrong")
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(SystemExit) as exc:  # the port is closed now
        serve.main(["--url", url, "--rates", "1"])
    assert str(exc.value.code).startswith(f"serve.py: error: no server answers at {url}: ConnectError")
    assert "%|" not in capsys.readouterr().err  # stopped before any run began


def test_a_run_without_data_is_written_as_strict_json_and_read_back() -> None:
    """A run with no remote prefill (no KV transfer) and no request of > 1 token (no
    TPOT): null in the JSON, not NaN (RFC 8259 has none), and every reader takes it."""
    from benchmarks.gpu.serving import _ms
    from benchmarks.offline.roofline.plots import serve_latencies
    from benchmarks.serving.compare import compare

    metrics = RouterMetrics().render().decode()
    results = [Result(5, 1, ok=True, ttft=0.2, e2e=0.2), Result(7, 1, ok=True, ttft=0.3, e2e=0.3)]
    run = summarize(results, 1.0, 5.0, 0.5) | {"seed": 0, "load": "poisson", "rate": 1.0,
                                               "kv_transfer": transfer_delta(metrics, metrics),
                                               "kv_hop": transfer_delta(metrics, metrics)}
    run["results"] = [dataclasses.asdict(r) | {"itl": None} for r in results]
    assert math.isnan(run["tpot"]["p50"]) and math.isnan(run["kv_transfer"]["mean"])
    text = json_text({"url": "u", "args": {"seeds": [0]}, "runs": [run], "rates": {1.0: run}})

    def strict(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    report = json.loads(text, parse_constant=strict)
    back = report["runs"][0]
    assert back["tpot"] == {"p50": None, "p90": None, "p99": None} and back["kv_transfer"]["p99"] is None
    assert back["kv_transfer"]["count"] == 0 and back["ttft"]["p50"] == pytest.approx(0.25)
    assert "TPOT -/-/- ms" in line("seed 0", back) and "KV transfer" not in line("seed 0", back)
    assert _ms(back["tpot"]) == "-/- ms" and _ms(back["ttft"]) == "250.0/299.0 ms"
    assert serve_latencies(report) == ([0.2, 0.3], [])
    assert "TTFT p50 | pooled (2 / 2 req)" in compare(report, report)
