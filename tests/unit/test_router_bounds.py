"""Bounded input at the router: body bytes (413, up front and while streaming in), a
body that trickles in (408), what a body may hold (400 naming the field), the
tokenizer's queue (429 with Retry-After), and bad bodies that must never be a 5xx."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cluster.config import ClusterConfig
from cluster.serve import router_for
from engine.tokenizer import load_tokenizer
from router.app import create_app
from router.bounds import MAX_CONTAINERS, MAX_DEPTH, InputBounds, check_bounds
from router.config import ModelLimits
from router.errors import APIError
from router.parsing import RequestParser
from tests.http_server import free_port, serving

USER = {"role": "user", "content": "Hi"}
BOUNDS = {"max_messages": 3, "max_stop": 2, "max_string_chars": 100, "max_body_bytes": 64 * 1024,
          "body_timeout_s": 1.0}


def config_for(llama_dir: Path, **router: Any) -> ClusterConfig:
    return ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0}, "router": router})


@pytest.fixture(scope="module")
def http(llama_dir: Path) -> Iterator[TestClient]:
    # A worker address nobody listens on: these requests never reach a worker.
    router = router_for(config_for(llama_dir, **BOUNDS), {"decode-0": "tcp://127.0.0.1:9"})
    with TestClient(create_app(router)) as client:
        yield client


@pytest.mark.parametrize("path,body,param,message", [
    ("/v1/chat/completions", {"messages": [USER] * 4}, "messages",
     "messages has 4 entries; at most 3 are accepted (router.max_messages)"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"]}, "stop",
     "stop has 3 entries; at most 2 are accepted (router.max_stop)"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1, 2, 3]}, "stop_token_ids",
     "stop_token_ids has 3 entries"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * 101]}, "stop",
     "stop[0] has 101 characters; at most 100 are accepted (router.max_string_chars)"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 101}, "stop", "stop has 101 characters"),
    ("/v1/completions", {"prompt": "hi", "model": "m" * 1000}, "model", "model has 1000 characters"),
    ("/v1/chat/completions", {"messages": [{"role": "r" * 101, "content": "Hi"}]}, "messages",
     "messages[0].role has 101 characters"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "i" * 101}]},
     "messages", "messages[0].tool_call_id has 101 characters"),
    ("/v1/chat/completions", {"messages": [USER], "tools": [
        {"type": "function", "function": {"name": "f", "description": "d" * 101}}]}, "tools",
     "tools[0].function.description has 101 characters"),
    ("/v1/chat/completions", {"messages": [USER], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "k" * 101: {"type": "string"}}}}}]}, "tools",
     "a key of tools[0].function.parameters.properties has 101 characters"),
    ("/v1/chat/completions", {"messages": [USER], "response_format": {"type": "json_schema", "json_schema": {
        "name": "n" * 101, "schema": {}}}}, "response_format", "response_format.json_schema.name has 101"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a" * 101}}, "structured_outputs",
     "structured_outputs.regex has 101 characters"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"k" * 101: 1}}, "response_format",
     "a key of response_format has 101 characters"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": "u" * 101}}, "stream_options",
     "stream_options.include_usage has 101 characters"),
    ("/v1/completions", {"prompt": "hi", "logprobs": "l" * 101}, "logprobs", "logprobs has 101 characters"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": json.loads("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))},
     "structured_outputs", f"structured_outputs{'[0]' * (MAX_DEPTH - 1)} is nested more than {MAX_DEPTH} levels deep"),
    ("/v1/chat/completions", {"messages": [USER], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": json.loads('{"a": ' * 300 + "1" + "}" * 300)}}]}, "tools",
     f"is nested more than {MAX_DEPTH} levels deep"),
    *[("/v1/chat/completions", {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": ' + "[" * n + "]" * n + "}"}}]}],
        "tools": [{"type": "function", "function": {"name": "f"}}]}, "messages",
       f"messages[1].tool_calls[0].function.arguments is nested more than {MAX_DEPTH} levels deep")
      for n in (MAX_DEPTH, 5000)],  # the chat template (at ~500) and json.loads (~3000) recurse too deep
])
def test_what_a_body_holds_is_bounded(http: TestClient, path: str, body: dict, param: str, message: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_a_field_holds_a_bounded_number_of_objects_and_arrays() -> None:
    bounds = InputBounds(3, 2, 100, 8)
    check_bounds({"tools": [[]] * (MAX_CONTAINERS - 1)}, bounds)
    for tools in ([[]] * MAX_CONTAINERS, [{"a": {}} for _ in range(MAX_CONTAINERS // 2)]):
        with pytest.raises(APIError, match=f"^tools holds more than {MAX_CONTAINERS} JSON objects and arrays$"):
            check_bounds({"tools": tools}, bounds)


def test_fields_pdserve_never_reads_are_bounded_by_the_body_size_alone() -> None:
    """An ignored field (`user`, an unknown one) is never looked at: walking it would
    only cost time on the event loop."""
    check_bounds({"user": "u" * 1000, "x" * 1000: json.loads("[" * 500 + "]" * 500)}, InputBounds(3, 2, 100, 8))


def test_the_conversation_itself_is_bounded_by_the_context_not_by_max_string_chars(llama_dir: Path) -> None:
    """The prompt, message contents (also as text parts) and a history tool call's
    arguments are held to the context length instead (RequestParser._check_chars)."""
    limits = ModelLimits(str(llama_dir), 256, 384, 16, None)
    parser = RequestParser(load_tokenizer(str(llama_dir)), limits, lambda: [], InputBounds(3, 2, 20, 8))
    long = "x" * 40  # > max_string_chars, < what the tiny model's context holds
    tools = [{"type": "function", "function": {"name": "f"}}]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": long})}}

    async def run() -> None:
        assert (await parser.completion(json.dumps({"prompt": long}).encode())).prompt_ids
        for messages in ([{"role": "user", "content": long}],
                         [{"role": "user", "content": [{"type": "text", "text": long}]}],
                         [{"role": "assistant", "content": None, "tool_calls": [call]}, USER]):
            body = {"messages": messages, "tools": tools, "max_tokens": 1}
            assert (await parser.chat(json.dumps(body).encode())).prompt_ids
        with pytest.raises(APIError, match="stop has 21 characters"):  # the same parser does bound the rest
            await parser.completion(json.dumps({"prompt": long, "stop": "s" * 21}).encode())

    asyncio.run(run())


def test_a_content_length_over_the_cap_is_413_before_the_body_is_read(http: TestClient) -> None:
    sent = []

    def body() -> Iterator[bytes]:  # would block the test forever if the router waited for it
        sent.append(1)
        yield b"{"

    r = http.post("/v1/completions", content=body(), headers={"content-length": str(64 * 1024 + 1)})
    assert r.status_code == 413 and r.headers["connection"] == "close"
    assert "the request body is 65537 bytes; at most 65536 bytes are accepted (router.max_body_bytes)" in r.text
    assert r.json()["error"]["code"] is None  # OpenAI's: a string or null, never the status


@pytest.fixture(scope="module")
def served_router(llama_dir: Path) -> Iterator[tuple[int, Any]]:
    """The router over real HTTP (uvicorn on 127.0.0.1): its port, the Router."""
    router = router_for(config_for(llama_dir, **BOUNDS), {"decode-0": "tcp://127.0.0.1:9"})
    port = free_port()
    with serving(router, port):
        yield port, router


@pytest.fixture
def served(served_router: tuple[int, Any]) -> int:
    return served_router[0]


def raw_request(port: int, headers: str) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}\r\n".encode())
    return conn


def read_all(conn: socket.socket) -> bytes:
    """Everything until the server closes the connection (a timeout fails the test)."""
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


# Past what the kernel's socket buffers take in: without the drain, the router's close
# (bytes unread) is a reset under a client still sending, and it never reads the 413.
BIG_CAP = 4 * 1024 * 1024
OVERSIZED = b'{"prompt": "' + b"a" * (BIG_CAP * 3 // 2) + b'"}'


@pytest.fixture(scope="module")
def served_big(llama_dir: Path) -> Iterator[int]:
    router = router_for(config_for(llama_dir, max_body_bytes=BIG_CAP), {"decode-0": "tcp://127.0.0.1:9"})
    port = free_port()
    with serving(router, port):
        yield port


@pytest.mark.timeout(60)
def test_urllib_sending_a_whole_oversized_body_reads_the_413(served_big: int) -> None:
    """urllib sends the whole body before it reads a byte: the router answers 413 on the
    Content-Length, then drains the body (a lingering close) rather than resetting the
    connection under it."""
    import urllib.error
    import urllib.request

    for _ in range(3):  # a fresh connection each time: each drained, none reset
        request = urllib.request.Request(f"http://127.0.0.1:{served_big}/v1/completions", data=OVERSIZED,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == 413 and err.value.headers["connection"] == "close"
        assert json.loads(err.value.read())["error"]["message"] == (
            f"the request body is {len(OVERSIZED)} bytes; at most {BIG_CAP} bytes are accepted (router.max_body_bytes)")


@pytest.mark.timeout(60)
def test_requests_sending_a_whole_oversized_body_reads_the_413(served_big: int) -> None:
    requests = pytest.importorskip("requests")
    for _ in range(3):
        r = requests.post(f"http://127.0.0.1:{served_big}/v1/completions", data=OVERSIZED,
                          headers={"Content-Type": "application/json"}, timeout=10)
        assert r.status_code == 413 and f"at most {BIG_CAP} bytes are accepted" in r.json()["error"]["message"]


@pytest.mark.timeout(60)
def test_a_body_past_twice_the_cap_is_not_drained(served: int) -> None:
    """The drain is bounded: past twice max_body_bytes, the connection closes (a reset
    for a client still sending), as before."""
    conn = raw_request(served, f"Content-Length: {2**30}\r\n")
    sent, start = 0, time.monotonic()
    with pytest.raises(OSError):
        while time.monotonic() - start < 8:  # drained for good, this would be gigabytes
            conn.sendall(b"a" * 65536)
            sent += 65536
    conn.close()
    assert sent < 32 * 2**20  # twice the cap, and what the kernel's socket buffers took in (a few MiB)


@pytest.mark.timeout(60)
def test_a_chunked_body_is_413_as_soon_as_it_passes_the_cap(served: int) -> None:
    conn = raw_request(served, "Transfer-Encoding: chunked\r\n")
    # One byte past the 64 KiB cap, and the body never ends (no last chunk). Nothing
    # more: bytes the server never reads would make its close a reset.
    for piece in [b"a" * 4096] * 16 + [b"a"]:
        conn.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
    reply = read_all(conn)
    conn.close()
    assert reply.startswith(b"HTTP/1.1 413 ") and b"connection: close" in reply.lower()
    assert b"the request body passed 65536 bytes" in reply


@pytest.mark.timeout(60)
def test_a_trickling_body_is_408_after_body_timeout_s_and_its_connection_closed(served: int) -> None:
    conn = raw_request(served, "Content-Length: 100\r\n")
    start = time.monotonic()

    def trickle() -> None:  # a byte every 0.1 s, never idle long, until just before the deadline
        while time.monotonic() - start < 0.9:
            conn.sendall(b" ")
            time.sleep(0.1)

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    reply = read_all(conn)  # ends: the server closed it
    sender.join()
    conn.close()
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert b"the request body did not arrive within 1 s (router.body_timeout_s)" in reply
    # The whole body's deadline, not a pause between bytes (that would end it after 1.9 s).
    assert 0.95 < time.monotonic() - start < 1.8


@pytest.mark.timeout(60)
def test_trickled_headers_are_cut_off_after_body_timeout_s(served: int) -> None:
    """A slowloris client, one header byte at a time, never gets its request in: the
    connection closes about body_timeout_s after it opened."""
    conn = socket.create_connection(("127.0.0.1", served), timeout=10)
    start = time.monotonic()
    conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    with pytest.raises(OSError):  # reset or broken pipe, once the server has closed it
        while time.monotonic() - start < 8:
            conn.sendall(b"a")
            time.sleep(0.1)
    conn.close()
    assert time.monotonic() - start < 4


@pytest.mark.timeout(60)
def test_a_body_an_endpoint_never_reads_is_not_drained_forever(served: int) -> None:
    """/health answers without reading a body: the connection then closes, rather than
    the server reading and dropping a chunked body for as long as the client sends it,
    past max_body_bytes and body_timeout_s."""
    conn = socket.create_connection(("127.0.0.1", served), timeout=10)
    conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    reply = conn.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200 ") and b"connection: close" in reply.lower()
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b"x" * 64 * 1024)
    start, sent = time.monotonic(), 0
    with pytest.raises(OSError):
        while time.monotonic() - start < 8:
            conn.sendall(chunk)
            sent += 64 * 1024
            time.sleep(0.01)
    conn.close()
    assert sent < 8 * BOUNDS["max_body_bytes"]  # twice the cap drained (a lingering close), and socket buffers


@pytest.mark.timeout(60)
def test_a_client_that_hangs_up_mid_body_is_no_server_error(served_router, caplog: pytest.LogCaptureFixture) -> None:
    port, router = served_router
    caplog.set_level(logging.WARNING)
    conn = raw_request(port, "Content-Length: 100\r\n")
    conn.sendall(b'{"prompt": "Hel')
    time.sleep(0.2)
    conn.close()
    metric = b'pdserve_requests_rejected_total{status="499"} 1.0'
    end = time.monotonic() + 10
    while metric not in router.metrics.render() and time.monotonic() < end:
        time.sleep(0.05)
    assert metric in router.metrics.render()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text  # no 500's traceback


def test_the_tokenizer_queue_is_bounded(llama_dir: Path) -> None:
    """With max_tokenize_queue requests waiting for (or in) the tokenizer, the next is a
    429 whose Retry-After is the queue's time at the recent pace."""
    tokenizer = load_tokenizer(str(llama_dir))
    release = threading.Event()

    class SlowTokenizer:
        def __getattr__(self, name: str) -> Any:
            return getattr(tokenizer, name)

        def encode(self, text: str, **kwargs: Any) -> list[int]:
            release.wait(10)
            return tokenizer.encode(text, **kwargs)

    limits = ModelLimits(str(llama_dir), 256, 384, 16, None)
    parser = RequestParser(SlowTokenizer(), limits, lambda: [], InputBounds(8, 8, 1000, max_tokenize_queue=2))
    parser._tokenize_s = 3.2  # the recent pace: 3.2 s a call

    async def run() -> None:
        first = [asyncio.ensure_future(parser.completion(b'{"prompt": "Hello"}')) for _ in range(2)]
        await asyncio.sleep(0.1)
        with pytest.raises(APIError) as err:
            await parser.completion(b'{"prompt": "Hello"}')
        assert err.value.status == 429 and err.value.retry_after == 7  # ceil(2 waiting * 3.2 s)
        assert "2 requests are waiting for the tokenizer (router.max_tokenize_queue)" in err.value.message
        release.set()
        assert all(r.prompt_ids for r in await asyncio.gather(*first))
        assert (await parser.completion(b'{"prompt": "Hello"}')).prompt_ids  # the queue drained

    asyncio.run(run())


def test_a_full_tokenizer_queue_takes_no_rate_token_from_the_key(llama_dir: Path) -> None:
    """The tokenizer's 429 is the server's load, not the key's doing: the request it
    refuses gives back its rate token, and the key's next request goes through."""
    router = router_for(config_for(llama_dir, key_requests_per_s=0.001, key_burst=1, max_tokenize_queue=1),
                        {"decode-0": "tcp://127.0.0.1:9"})
    with TestClient(create_app(router)) as client:
        router.parser._tokenizing = 1  # as if one request were in the tokenizer
        busy = client.post("/tokenize", json={"prompt": "Hello"})
        assert busy.status_code == 429 and "waiting for the tokenizer" in busy.json()["error"]["message"]
        router.parser._tokenizing = 0
        assert client.post("/tokenize", json={"prompt": "Hello"}).status_code == 200  # the key's one token
        over = client.post("/tokenize", json={"prompt": "Hello"})
        assert over.status_code == 429 and "over its rate" in over.json()["error"]["message"]  # spent now


# Bad bodies (as a fuzzer or a broken client sends them): each a 4xx, never a 5xx.
NASTY: list[bytes] = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 900 + b"1" + b"}" * 900,
    b'{"prompt": "hi", "tools": ' + b"[" * 900 + b"]" * 900 + b"}",
    b'{"messages": [{"role": "user", "content": ' + b"[" * 500 + b"]" * 500 + b"}]}",
    b'{"prompt": "\xff\xfe\x80 hi"}',
    b'{"prompt": "hi", "max_tokens": 1e999}',
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 4000 + b"}",
    b'{"prompt": "hi", "temperature": NaN}',
    b'{"prompt": "hi", "top_p": -Infinity}',
    b'{"prompt": "hi", "seed": -1e308}',
    b'{"prompt": [1e30]}',
    b'{"prompt": [-1]}',
    b'{"prompt": {"a": 1}}',
    b'{"prompt": null}',
    b'{"prompt": true}',
    b'{"prompt": "hi", "stop": [1, 2]}',
    b'{"prompt": "hi", "stop": {"a": "b"}}',
    b'{"prompt": "hi", "logprobs": "x"}',
    b'{"prompt": "hi", "stream_options": {"include_usage": "yes"}, "stream": true}',
    b'{"messages": "hi"}',
    b'{"messages": [1, 2]}',
    b'{"messages": [{"role": 1, "content": "x"}]}',
    b'{"messages": [{"role": "user", "content": {"text": "x"}}]}',
    b'{"messages": [{"role": "user", "content": "x"}], "tools": "all"}',
    b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": 5}}]}',
    b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": 1}}',
    b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
    b'"json_schema": {"name": "n", "schema": []}}}',
    b'{"prompt": "hi", "structured_outputs": 7}',
    b'{"prompt": "\\udc00\\ud800"}',
    b'"just a string"',
    b"",
    b"null",
    b"{" * 10,
    b'{"prompt": "hi"' + b" " * 100_000 + b"}",
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_bodies_are_never_a_5xx(http: TestClient, path: str) -> None:
    for body in NASTY:
        for stream in (False, True):
            raw = body if not stream or not body.startswith(b"{\"") else body[:-1] + b', "stream": true}'
            r = http.post(path, content=raw, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (body[:80], r.status_code, r.text[:300])
            assert r.json()["error"]["message"], r.text[:300]


def test_a_chats_default_max_tokens_fits_a_keys_tokens_in_flight(llama_dir: Path) -> None:
    """A chat without max_tokens asks for the rest of the context, unless a key may hold
    fewer tokens in flight: then for what that leaves, not a 400 about a max_tokens the
    client never sent."""
    limits = ModelLimits(str(llama_dir), 256, 384, 16, None)
    parser = RequestParser(load_tokenizer(str(llama_dir)), limits, lambda: [], InputBounds(3, 2, 20, 8, 100))
    unbounded = RequestParser(parser.tokenizer, limits, lambda: [], InputBounds(3, 2, 20, 8))
    body = json.dumps({"messages": [USER]}).encode()

    async def run() -> None:
        chat = await parser.chat(body)
        assert chat.params.max_tokens == 100 - len(chat.prompt_ids)
        assert (await unbounded.chat(body)).params.max_tokens == 256 - len(chat.prompt_ids)

    asyncio.run(run())


def test_the_router_bounds_its_parser_without_the_http_app(llama_dir: Path) -> None:
    router = router_for(config_for(llama_dir, max_messages=5), {"decode-0": "tcp://127.0.0.1:9"})
    assert router.parser.bounds is not None and router.parser.bounds.max_messages == 5
