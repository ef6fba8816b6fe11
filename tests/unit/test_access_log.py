"""The router's access log (router/access_log.py) over real HTTP, against the fake decode
worker of test_router_http: one line per request, with its id, status, tokens, timings,
finish reason, prefill place and worker; a stream's line when it ends (499 when its
client leaves); rejected requests too; a key only by its fingerprint; off when
router.access_log is false. No model runs."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cluster.config import ClusterConfig
from cluster.serve import router_for
from router.access_log import LOGGER
from tests.http_server import free_port, serving
from tests.unit.test_router_http import FakeDecodeWorker, open_request, wait_for

LINE = re.compile(r'^(?P<client>127\.0\.0\.1:\d+) "(?P<method>[A-Z]+) (?P<path>\S+)" (?P<status>\d{3})(?P<fields>.*)$')
KEY = "sk-access-log-0123456789"


@pytest.fixture
def fake() -> Iterator[FakeDecodeWorker]:
    worker = FakeDecodeWorker()
    yield worker
    worker.close()


@contextmanager
def served(llama_dir: Path, fake: FakeDecodeWorker, **router: Any) -> Iterator[str]:
    config = ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0}, "router": router})
    with serving(router_for(config, {"decode-0": fake.address}), free_port()) as base:
        yield base


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """Every access log line, parsed: its head's parts and its key=value fields."""
    out = []
    for record in caplog.records:
        if record.name == LOGGER:
            match = LINE.match(record.getMessage())
            assert match, record.getMessage()
            fields = dict(f.split("=", 1) for f in match["fields"].split())
            out.append({**match.groupdict(), **fields, "line": record.getMessage()})
    return out


def next_line(caplog: pytest.LogCaptureFixture, seen: int) -> dict[str, Any]:
    """The one line logged after the first `seen` (a response's line follows its last byte)."""
    wait_for(lambda: len(lines(caplog)) > seen, 5, "the request's access log line")
    found = lines(caplog)
    assert len(found) == seen + 1, found
    return found[-1]


def post(base: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    response = open_request(base, "POST", path, body, timeout=20, headers=headers)
    return response.status, response.read()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream,phases,prefill", [
    (False, {"queue": 0.0, "prefill": 0.0, "decode": 0.0}, "local"),
    (True, {"queue": 0.0, "transfer": 0.01, "prefill": 0.0, "decode": 0.0}, "remote"),  # its KV came from a prefill worker
])
def test_a_served_request_is_one_line_when_it_ends(llama_dir: Path, fake: FakeDecodeWorker,
                                                    caplog: pytest.LogCaptureFixture, stream: bool,
                                                    phases: dict[str, float], prefill: str) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    fake.phases, fake.remote = phases, prefill == "remote"
    with served(llama_dir, fake) as base:
        status, body = post(base, "/v1/completions", {"prompt": "Hello there", "max_tokens": 3, "stream": stream})
        assert status == 200
        line = next_line(caplog, 0)
    events = [json.loads(e[len("data: "):]) for e in body.decode().split("\n\n") if e.startswith("data: {")]
    response_id = events[0]["id"] if stream else json.loads(body)["id"]
    prompt = fake.messages("generate")[0].prompt
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/completions", "200")
    assert line["id"] == response_id and int(line["prompt_tokens"]) == len(prompt) and line["output_tokens"] == "3"
    assert (line["finish"], line["prefill"], line["worker"]) == ("length", prefill, "decode-0")
    ttft, total = float(line["ttft"].rstrip("s")), float(line["total"].rstrip("s"))
    assert 0 < ttft < total < 10 and "key" not in line  # 3 steps of 0.05 s: the first token comes before the last


@pytest.mark.timeout(60)
def test_a_stream_whose_client_leaves_is_logged_as_499(llama_dir: Path, fake: FakeDecodeWorker,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    with served(llama_dir, fake) as base:
        response = open_request(base, "POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1000, "stream": True}, timeout=20)
        events = 0
        for raw in response:
            events += raw.startswith(b"data: ")
            if events == 3:
                break
        response.close()  # 1000 tokens would take the fake 50 s
        line = next_line(caplog, 0)
    assert (line["path"], line["status"], line["finish"]) == ("/v1/chat/completions", "499", "abort")
    assert line["id"].startswith("chatcmpl-") and 2 <= int(line["output_tokens"]) < 1000
    assert line["ttft"] != "-" and line["worker"] == "decode-0"


@pytest.mark.timeout(60)
def test_a_stream_broken_after_its_first_event_says_the_error(llama_dir: Path, fake: FakeDecodeWorker,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    with served(llama_dir, fake, health_interval_s=0.1, worker_timeout_s=0.6) as base:
        response = open_request(base, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1000, "stream": True},
                                timeout=20)
        events: list[bytes] = []
        for raw in response:  # to the end of the body
            if raw.startswith(b"data: "):
                events.append(raw)
                if len(events) == 2:
                    fake.silent.set()  # dies, with no other worker to fail over to
        line = next_line(caplog, 0)
        metrics = open_request(base, "GET", "/metrics", None, timeout=20).read().decode()
    assert b"[DONE]" in events[-1]
    assert b"no decode worker is alive (decode-0 sent nothing for 0.6 s); retry later" in events[-2]
    assert (line["status"], line["finish"], line["prefill"]) == ("200", "error(503)", "-")
    assert int(line["output_tokens"]) >= 1
    # One outcome: finished with an error (neither aborted by its client nor refused).
    assert 'pdserve_requests_finished_total{reason="error"} 1.0' in metrics
    assert 'reason="abort"' not in metrics and "pdserve_requests_rejected_total{" not in metrics


@pytest.mark.timeout(60)
def test_rejected_requests_are_logged_and_a_key_only_by_its_fingerprint(llama_dir: Path, fake: FakeDecodeWorker,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    bearer = {"Authorization": f"Bearer {KEY}"}
    with served(llama_dir, fake, api_keys=[KEY], max_body_bytes=4096) as base:
        assert post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 401  # the guard's
        no_key = next_line(caplog, 0)
        assert post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": -1}, bearer)[0] == 400  # the parser's
        bad = next_line(caplog, 1)
        assert post(base, "/v1/completions", {"prompt": "x" * 5000, "max_tokens": 2}, bearer)[0] == 413
        too_large = next_line(caplog, 2)
        assert post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, bearer)[0] == 200
        served_line = next_line(caplog, 3)
    fingerprint = hashlib.sha256(KEY.encode()).hexdigest()[:8]
    assert no_key["status"] == "401" and "key" not in no_key and no_key["id"] == "-" and no_key["finish"] == "-"
    assert bad["status"] == "400" and bad["key"] == fingerprint and bad["output_tokens"] == "0"
    assert too_large["status"] == "413" and too_large["key"] == fingerprint
    assert served_line["status"] == "200" and served_line["key"] == fingerprint and served_line["finish"] == "length"
    assert KEY not in caplog.text


@pytest.mark.timeout(60)
def test_other_endpoints_get_a_short_line_and_access_log_false_silences_all(
        llama_dir: Path, fake: FakeDecodeWorker, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    with served(llama_dir, fake) as base:
        assert open_request(base, "GET", "/health", None, timeout=20).status == 200
        health = next_line(caplog, 0)
    assert (health["method"], health["path"], health["status"]) == ("GET", "/health", "200")
    assert set(health) - {"client", "method", "path", "status", "fields", "line"} == {"total"}
    with served(llama_dir, fake) as base:  # a path that would write a line of its own
        forged = '/x%0d%0aINFO%20pdserve.access:%2010.9.9.9:1%20%22POST%20/v1/completions%22%20200'
        assert open_request(base, "GET", forged, None, timeout=20).status == 404
        line = next_line(caplog, 1)
    assert "\n" not in line["line"] and "\r" not in line["line"] and line["status"] == "404"
    assert line["path"] == "/x%0D%0AINFO%20pdserve.access%3A%2010.9.9.9%3A1%20%22POST%20/v1/completions%22%20200"
    caplog.clear()
    with served(llama_dir, fake, access_log=False) as base:
        assert post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200
        assert post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": -1})[0] == 400
        assert open_request(base, "GET", "/health", None, timeout=20).status == 200
    assert lines(caplog) == []


@pytest.mark.timeout(60)
def test_a_request_refused_after_tokenizing_logs_its_prompts_length(llama_dir: Path, fake: FakeDecodeWorker,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A prompt too long for the context, or one whose max_tokens overflows it, was
    tokenized before it was refused: its line says how long it was (not `-`)."""
    from engine.tokenizer import load_tokenizer

    caplog.set_level(logging.INFO, logger=LOGGER)
    tokenizer = load_tokenizer(str(llama_dir))
    long, short = "the quick brown fox " * 400, "Hello there"  # past the tiny model's context of 1024
    with served(llama_dir, fake) as base:
        assert post(base, "/v1/completions", {"prompt": long, "max_tokens": 1})[0] == 400
        too_long = next_line(caplog, 0)
        assert post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": short}],
                                                   "max_tokens": 1024})[0] == 400
        overflow = next_line(caplog, 1)
        assert post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 0})[0] == 400  # refused before tokenizing
        untokenized = next_line(caplog, 2)
    assert len(tokenizer.encode(long)) > 1024 and too_long["prompt_tokens"] == str(len(tokenizer.encode(long)))
    assert int(overflow["prompt_tokens"]) > len(tokenizer.encode(short))  # with the chat template's tokens
    assert untokenized["prompt_tokens"] == "-" and not fake.messages("generate")
