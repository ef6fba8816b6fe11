"""The router over real HTTP (uvicorn on 127.0.0.1) against a fake decode worker that
speaks the worker protocol from a thread: what a client sees when it hangs up, when
its worker dies mid-stream, while a prompt is being tokenized, and which sampling
settings reach the worker. No model runs, so these take seconds."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import zmq

from cluster.config import ClusterConfig
from cluster.serve import router_for
from protocol import WORKER_MESSAGES, Message, Rejected, StatsReply, Tokens, encode
from router.app import Router
from router.core import MAX_RETRIES
from tests.http_server import free_port, serving
from tests.worker_stats import worker_stats

decode = WORKER_MESSAGES.decode

TOKEN = 70  # any id of the tiny vocabulary: the fake worker "generates" it again and again


class FakeDecodeWorker:
    """Answers pings; sends each request `per_step` tokens every step_s until its
    max_tokens; records every message it receives. `silent` set: it answers nothing (a
    dead one)."""

    def __init__(self, step_s: float = 0.05, per_step: int = 1) -> None:
        self.step_s, self.per_step = step_s, per_step
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.received: list[dict[str, Any]] = []
        self.stats = worker_stats()  # what its stats replies say
        self.retry_next = 0  # this many next requests get one token, then Rejected(retry=True)
        self.phases = {"queue": 0.0, "prefill": 0.0, "decode": 0.0}  # with each request's last tokens
        self.remote = False  # with each request's last tokens: its prompt KV came from a prefill worker
        self.silent = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def messages(self, kind: str) -> list[Message]:
        return [m for m in list(self.received) if m.kind == kind]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        self.ctx.term()

    def _run(self) -> None:
        active: dict[str, list[Any]] = {}  # id -> [sender, tokens left]
        next_step = time.monotonic()
        while not self._stop.is_set():
            if self.sock.poll(10):
                sender, payload = self.sock.recv_multipart()
                msg = decode(payload)
                self.received.append(msg)
                if self.silent.is_set():
                    continue
                if msg.kind == "stats":
                    self.sock.send_multipart([sender, encode(StatsReply(seq=msg.seq, stats=self.stats))])
                elif msg.kind == "generate" and self.retry_next:  # as after a late KV write
                    self.retry_next -= 1
                    self.sock.send_multipart([sender, encode(Tokens(request_id=msg.request_id, tokens=[TOKEN],
                                                                    finished=False, reason="", cached=0))])
                    self.sock.send_multipart([sender, encode(Rejected(
                        request_id=msg.request_id, error="blocks overwritten", status=500, retry=True))])
                elif msg.kind == "generate":
                    active[msg.request_id] = [sender, msg.params.max_tokens, msg.params.logprobs is not None]
                elif msg.kind == "abort":
                    active.pop(msg.request_id, None)
            if time.monotonic() >= next_step and not self.silent.is_set():
                next_step = time.monotonic() + self.step_s
                for rid, state in list(active.items()):
                    n = min(self.per_step, state[1])
                    state[1] -= n
                    done = state[1] == 0
                    self.sock.send_multipart([state[0], encode(Tokens(
                        request_id=rid, tokens=[TOKEN] * n, finished=done, reason="length" if done else "",
                        cached=0, logprobs=[(-0.5, [])] * n if state[2] else [], phases=dict(self.phases) if done else {},
                                          remote=done and self.remote))])
                    if done:
                        del active[rid]


@pytest.fixture
def fake() -> Iterator[FakeDecodeWorker]:
    worker = FakeDecodeWorker()
    yield worker
    worker.close()


@pytest.fixture
def served(llama_dir: Path, fake: FakeDecodeWorker) -> Iterator[tuple[str, Router, FakeDecodeWorker]]:
    config = ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0},
                                      "router": {"health_interval_s": 0.1, "worker_timeout_s": 0.6}})
    router = router_for(config, {"decode-0": fake.address})
    with serving(router, free_port()) as base:
        yield base, router, fake


def request(base: str, method: str, path: str, body: dict[str, Any] | None = None,
            timeout: float = 20) -> tuple[int, Any]:
    """(status, JSON body) of one request; raises TimeoutError when the answer takes longer."""
    response = open_request(base, method, path, body, timeout)
    return response.status, json.loads(response.read())


def open_request(base: str, method: str, path: str, body: dict[str, Any] | None,
                 timeout: float, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"Content-Type": "application/json", **(headers or {})})
    return conn.getresponse()


def slow_tokenizer(router: Any) -> None:
    """Make the router's tokenizer take 2 s per encode, as a huge prompt would."""
    tokenizer = router.tokenizer

    class SlowTokenizer:
        def __getattr__(self, name: str) -> Any:
            return getattr(tokenizer, name)

        def encode(self, text: str, **kwargs: Any) -> list[int]:
            time.sleep(2.0)
            return tokenizer.encode(text, **kwargs)

    router.tokenizer = SlowTokenizer()


def wait_for(condition: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_a_non_streamed_request_whose_client_hangs_up_is_aborted(served) -> None:
    base, _, fake = served
    with pytest.raises(TimeoutError):  # 1000 tokens take the fake 50 s; give up after 0.5 s
        request(base, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 1000}, timeout=0.5)
    rid = fake.messages("generate")[0].request_id
    wait_for(lambda: any(m.request_id == rid for m in fake.messages("abort")), 5,
             "the router aborts the request of a client that went away")


@pytest.mark.timeout(60)
def test_a_stream_whose_worker_dies_ends_with_an_error_event_then_done(served) -> None:
    base, _, fake = served
    events = []
    response = open_request(base, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 1000, "stream": True},
                            timeout=20)
    assert response.status == 200
    for line in response:  # to the end of the body: a truncated one raises here
        if line.startswith(b"data: "):
            events.append(line[len(b"data: "):].decode().strip())
            if len(events) == 2:
                fake.silent.set()  # dies: the router declares it dead, with no other to fail over to
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] is None and "no decode worker is alive" in error["message"]
    assert all("choices" in json.loads(e) for e in events[:-2])


@pytest.mark.timeout(60)
def test_health_answers_while_a_prompt_is_tokenized(served) -> None:
    base, router, _ = served
    slow_tokenizer(router)
    result: dict[str, int] = {}
    post = threading.Thread(target=lambda: result.update(status=request(
        base, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2})[0]))
    post.start()
    time.sleep(0.3)  # the request is in the tokenizer now
    start = time.monotonic()
    assert request(base, "GET", "/health")[0] == 200
    assert time.monotonic() - start < 1.0  # not after the 2 s tokenization
    post.join(20)
    assert result["status"] == 200


@pytest.mark.timeout(60)
def test_settings_reach_the_worker(served) -> None:
    base, router, fake = served
    status, out = request(base, "POST", "/v1/completions", {
        "prompt": "Hello", "max_tokens": 3, "n": None, "stop_token_ids": [5], "include_stop_str_in_output": True,
        "min_tokens": 2, "ignore_eos": True, "best_of": 1, "user": "me", "echo": False})
    assert status == 200 and out["usage"]["completion_tokens"] == 3
    params = fake.messages("generate")[-1].params
    assert params.stop_token_ids == [5] and params.include_stop_str_in_output is True
    assert params.min_tokens == 2 and params.ignore_eos is True and params.max_tokens == 3

    status, _ = request(base, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2})
    assert status == 200 and fake.messages("generate")[-1].params.max_tokens == 2


@pytest.mark.timeout(60)
def test_chat_without_max_tokens_may_fill_the_context_and_takes_text_parts(served) -> None:
    base, router, fake = served
    fake.per_step = 200
    status, out = request(base, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
                     {"role": "assistant", "content": None}, {"role": "user", "content": "Go on"}]})
    assert status == 200, out
    sent = fake.messages("generate")[-1]
    assert sent.params.max_tokens == router.max_model_len - len(sent.prompt)
    assert out["usage"]["completion_tokens"] == sent.params.max_tokens
    text = router.tokenizer.apply_chat_template(  # the parts joined as vLLM joins them
        [{"role": "user", "content": "Hi\nthere"}, {"role": "assistant", "content": ""},
         {"role": "user", "content": "Go on"}], add_generation_prompt=True, tokenize=False)
    assert sent.prompt == router.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.timeout(60)
def test_chat_without_max_tokens_fits_the_smallest_kv_pool(served) -> None:
    """A decode worker whose KV pool holds fewer tokens than the context refuses a
    request that would not fit it: the default stops at what the pool holds."""
    base, router, fake = served
    fake.per_step = 200
    fake.stats = worker_stats(num_blocks=10)  # 160 tokens of 16-token blocks
    wait_for(lambda: router.pool.decode["decode-0"].num_kv_blocks == 10, 10, "the router reads the pool size from a stats reply")
    status, out = request(base, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200, out
    sent = fake.messages("generate")[-1]
    assert sent.params.max_tokens == 10 * router.block_size - len(sent.prompt) < router.max_model_len


# A decode worker that asks for a retry (Rejected.retry: a late KV write overwrote the
# request's blocks) gets the request back as after a failover; one that keeps asking is bounded.
@pytest.mark.timeout(60)
def test_a_retry_resubmits_prompt_and_tokens_so_far(served: tuple) -> None:
    base, router, fake = served
    fake.retry_next = 1
    status, body = request(base, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 5})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
    first, second = fake.messages("generate")
    assert second.prompt == first.prompt + [TOKEN] and second.params.max_tokens == 4 and second.resumed == 1
    assert b"pdserve_decode_failovers_total 1.0" in router.metrics.render()


@pytest.mark.timeout(60)
def test_a_worker_that_keeps_asking_fails_the_request(served: tuple) -> None:
    base, _, fake = served
    fake.retry_next = MAX_RETRIES + 1
    status, body = request(base, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 8})
    assert status == 500 and "blocks overwritten" in body["error"]["message"], body
    assert len(fake.messages("generate")) == MAX_RETRIES + 1


def test_a_stop_string_inside_a_batch_of_tokens_ends_the_output_there(served) -> None:
    """A speculative step sends several tokens at once: those after the one that
    completes a stop string are not output (tokens, logprobs, usage), as when they
    come one at a time."""
    base, _, fake = served
    fake.per_step = 4
    body = {"prompt": "Hi", "max_tokens": 12, "stop": ["ee"], "logprobs": 0}
    status, out = request(base, "POST", "/v1/completions", body)
    assert status == 200 and out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["text"] == ""
    assert out["usage"]["completion_tokens"] == 2 and len(out["choices"][0]["logprobs"]["tokens"]) == 2
