"""The router side of n, best_of and batched prompts over real HTTP, against fake decode
workers that answer a Generate of params.n sequences under child ids, as the real one
does: one Generate per prompt, choices by index and interleaved, per-sequence failover
and stop strings, aborts on disconnect, best_of's ranking, usage (cached tokens too),
the role in each chat choice's first delta only, and a stream's headers sent before
its first token. No model runs, so these take seconds."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from cluster.config import ClusterConfig
from cluster.serve import router_for
from protocol import WORKER_MESSAGES, Message, Rejected, StatsReply, Tokens, child_request_id, encode
from router.access_log import LOGGER
from router.app import Router
from router.errors import APIError
from router.limits import Limits
from tests.http_server import free_port, serving
from tests.unit.test_router_http import open_request, request, wait_for
from tests.worker_stats import worker_stats

BASE = 70  # sequence i of the g-th Generate a worker gets emits token BASE + 4 * g + i, again and again


class FanoutWorker:
    """A decode worker that speaks the n > 1 contract: a Generate of params.n sequences
    is answered under child_request_id(id, i) for each (n = 1: under the id). Every
    step_s each running sequence gets one token (see BASE) with logprob -(i + 1) *
    logprob_step[i] when asked, and `cached` as its prefix-cache hit. Set `hold`: it
    sends no tokens; `silent`: it answers nothing (a dead one). retry_child: that child
    of the first group gets one token, then Rejected(retry=True). reject_child: that
    child of the first group is Rejected (400) at once."""

    def __init__(self, step_s: float = 0.03) -> None:
        self.step_s = step_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.received: list[Message] = []
        self.cached = 0
        self.logprob_step = [0.1] * 16
        self.retry_child: int | None = None
        self.reject_child: int | None = None
        self.hold = threading.Event()
        self.silent = threading.Event()
        self.stats: dict[str, Any] = {}  # WorkerStats fields its stats replies carry (else zeros)
        self._generates = 0
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

    def _tokens(self, sender: bytes, rid: str, tokens: list[int], done: bool, lps: list | None) -> None:
        self.sock.send_multipart([sender, encode(Tokens(
            request_id=rid, tokens=tokens, finished=done, reason="length" if done else "", cached=self.cached,
            logprobs=lps or [], phases={"queue": 0.0, "prefill": 0.0, "decode": 0.0} if done else {}))])

    def _run(self) -> None:
        active: dict[str, list[Any]] = {}  # id -> [sender, tokens left, token, child index, logprobs?]
        next_step = time.monotonic()
        while not self._stop.is_set():
            if self.sock.poll(5):
                sender, payload = self.sock.recv_multipart()
                msg = WORKER_MESSAGES.decode(payload)
                self.received.append(msg)
                if self.silent.is_set():
                    continue
                if msg.kind == "stats":
                    self.sock.send_multipart([sender, encode(StatsReply(seq=msg.seq, stats=worker_stats(**self.stats)))])
                elif msg.kind == "generate":
                    g, n = self._generates, msg.params.n
                    self._generates += 1
                    for i in range(n):
                        rid = child_request_id(msg.request_id, i) if n > 1 else msg.request_id
                        if g == 0 and i == self.reject_child:
                            self.sock.send_multipart([sender, encode(Rejected(
                                request_id=rid, error="no good", status=400, param="prompt"))])
                            continue
                        active[rid] = [sender, msg.params.max_tokens, BASE + 4 * g + i, i,
                                       msg.params.logprobs is not None, g == 0 and i == self.retry_child]
                elif msg.kind == "abort":
                    active.pop(msg.request_id, None)
            if time.monotonic() >= next_step and not self.silent.is_set() and not self.hold.is_set():
                next_step = time.monotonic() + self.step_s
                for rid, (sender, left, token, i, lps, retry) in list(active.items()):
                    active[rid][1] = left - 1
                    lp = [(-(i + 1) * self.logprob_step[i], [(token, -(i + 1) * self.logprob_step[i])])] if lps else None
                    self._tokens(sender, rid, [token], left == 1, lp)
                    if retry:  # as after a late KV write: the router resubmits it
                        self.sock.send_multipart([sender, encode(Rejected(
                            request_id=rid, error="blocks overwritten", status=500, retry=True))])
                    if left == 1 or retry:
                        del active[rid]


@pytest.fixture
def workers() -> Iterator[list[FanoutWorker]]:
    made = [FanoutWorker(), FanoutWorker()]
    yield made
    for worker in made:
        worker.close()


@pytest.fixture
def served(llama_dir: Path, workers: list[FanoutWorker]) -> Iterator[tuple[str, Router, FanoutWorker]]:
    """The router with one decode worker."""
    config = ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0},
                                      "router": {"health_interval_s": 0.1, "worker_timeout_s": 0.6}})
    router = router_for(config, {"decode-0": workers[0].address})
    with serving(router, free_port()) as base:
        yield base, router, workers[0]


def stream(base: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed answer's JSON events (not [DONE], which must end it)."""
    response = open_request(base, "POST", path, {**body, "stream": True}, timeout=20)
    assert response.status == 200
    events = [line[len(b"data: "):].decode().strip() for line in response if line.startswith(b"data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def text(router: Router, token: int, times: int) -> str:
    return router.tokenizer.decode([token] * times)


@pytest.mark.timeout(60)
def test_n_is_one_generate_whose_choices_stream_interleaved_by_index(served, caplog) -> None:
    base, router, worker = served
    caplog.set_level(logging.INFO, logger=LOGGER)
    events = stream(base, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "n": 3, "seed": 7,
                                              "stream_options": {"include_usage": True}})
    (generate,) = worker.messages("generate")
    assert generate.params.n == 3 and generate.params.seed == 7
    chunks = [e["choices"] for e in events[:-1]]
    assert all(len(c) == 1 for c in chunks)  # one choice per event
    order = [c[0]["index"] for c in chunks]
    assert sorted(set(order)) == [0, 1, 2] and order[:3] != [0, 0, 0]  # interleaved as they come
    for i in range(3):
        mine = [c[0] for c in chunks if c[0]["index"] == i]
        assert "".join(c["text"] for c in mine) == text(router, BASE + i, 4)
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] == len(generate.prompt)  # the prompt once
    wait_for(lambda: any(r.name == LOGGER and "output_tokens=12" in r.getMessage() for r in caplog.records), 5,
             "the access log line sums the sequences' tokens")


@pytest.mark.timeout(60)
def test_chat_n_answers_each_choice_and_streams_the_role_in_its_first_delta_only(served) -> None:
    base, router, worker = served
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 2}
    status, out = request(base, "POST", "/v1/chat/completions", body)
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in out["choices"]] == [text(router, BASE + i, 3) for i in range(2)]
    assert all(c["finish_reason"] == "length" and c["message"]["role"] == "assistant" for c in out["choices"])
    events = stream(base, "/v1/chat/completions", body)
    for i in range(2):
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"][0]["index"] == i]
        assert len(deltas) == 3 and deltas[0]["role"] == "assistant"
        assert all("role" not in d for d in deltas[1:])
        assert "".join(d["content"] for d in deltas) == text(router, BASE + 4 + i, 3)  # the second Generate's


@pytest.mark.timeout(60)
def test_best_of_answers_the_sequences_of_highest_cumulative_logprob(served) -> None:
    base, router, worker = served
    worker.logprob_step = [0.5, 0.4, 0.01, 0.3]  # sequence 2's tokens are likeliest, then 0 (-0.5 vs -0.8 per token)
    status, out = request(base, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "best_of": 3})
    assert status == 200, out
    (generate,) = worker.messages("generate")
    assert generate.params.n == 3 and generate.params.logprobs == 0  # to rank by, though none were asked
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["text"] == text(router, BASE + 2, 3) and choice["logprobs"] is None
    assert out["usage"]["completion_tokens"] == 3  # the answered choice's only
    status, out = request(base, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "best_of": 3,
                                                            "n": 2, "logprobs": 1})
    assert status == 200, out
    assert [c["text"] for c in out["choices"]] == [text(router, BASE + 4 + 2, 3), text(router, BASE + 4, 3)]
    assert out["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx([-0.03] * 3)
    assert [c["index"] for c in out["choices"]] == [0, 1] and out["usage"]["completion_tokens"] == 6


@pytest.mark.timeout(60)
def test_batched_prompts_are_one_generate_each_and_choices_index_by_prompt_then_sequence(served) -> None:
    base, router, worker = served
    worker.cached = 3
    status, out = request(base, "POST", "/v1/completions", {"prompt": ["Hello", "Good morning to you"],
                                                            "max_tokens": 2, "n": 2})
    assert status == 200, out
    first, second = worker.messages("generate")
    assert first.prompt == router.tokenizer.encode("Hello") and second.prompt == router.tokenizer.encode(
        "Good morning to you") and first.params.n == second.params.n == 2
    # Choice index = prompt index * n + i (OpenAI's); prompt p's sequences come from its own Generate.
    assert [(c["index"], c["text"]) for c in out["choices"]] == [
        (2 * p + i, text(router, BASE + 4 * p + i, 2)) for p in range(2) for i in range(2)]
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(first.prompt) + len(second.prompt) and usage["completion_tokens"] == 8
    assert usage["prompt_tokens_details"] == {"cached_tokens": 6}  # each prompt's hit once
    status, out = request(base, "POST", "/v1/completions", {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 1})
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1], out
    assert [m.prompt for m in worker.messages("generate")[2:]] == [[5, 6, 7], [8, 9]]


@pytest.mark.timeout(60)
def test_a_sequence_the_worker_asks_to_retry_is_resubmitted_alone(served) -> None:
    base, router, worker = served
    worker.retry_child = 1
    status, out = request(base, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "n": 3, "seed": 7})
    assert status == 200, out
    group, again = worker.messages("generate")
    assert again.params.n == 1 and again.params.seed == 8 and again.resumed == 1  # child(1): seed + 1
    assert again.prompt == group.prompt + [BASE + 1] and again.params.max_tokens == 3
    texts = [c["text"] for c in out["choices"]]
    assert texts[0] == text(router, BASE, 4) and texts[2] == text(router, BASE + 2, 4)
    assert texts[1] == router.tokenizer.decode([BASE + 1] + [BASE + 4] * 3)  # its own tokens, then the new run's
    assert out["usage"]["completion_tokens"] == 12
    assert b"pdserve_decode_failovers_total 1.0" in router.metrics.render()


@pytest.mark.timeout(60)
def test_the_sequences_of_a_dead_worker_fail_over_each_alone(llama_dir: Path, workers: list[FanoutWorker]) -> None:
    config = ClusterConfig.from_dict({"model": str(llama_dir), "prefill": {"replicas": 0},
                                      "router": {"health_interval_s": 0.1, "worker_timeout_s": 0.6,
                                                 "policy": "round_robin"}})
    router = router_for(config, {"decode-0": workers[0].address, "decode-1": workers[1].address})
    with serving(router, free_port()) as base:
        wait_for(lambda: all(w.alive for w in router.pool.decode.values()), 10, "both workers answer")
        response = open_request(base, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 30, "n": 2,
                                                                  "seed": 3, "stream": True}, timeout=20)
        events = []
        for line in response:
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 4:  # two tokens each, then its worker dies
                    dead = next(w for w in workers if w.messages("generate"))
                    dead.silent.set()
    live = next(w for w in workers if w is not dead)
    resubmitted = sorted(live.messages("generate"), key=lambda m: m.params.seed)
    assert [(m.params.n, m.params.seed) for m in resubmitted] == [(1, 3), (1, 4)]
    for i in range(2):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
        assert sum(len(router.tokenizer.encode(c["text"], add_special_tokens=False)) for c in mine) >= 2
        assert mine[-1]["finish_reason"] == "length"


@pytest.mark.timeout(60)
def test_a_client_gone_aborts_every_sequence(served) -> None:
    base, router, worker = served
    with pytest.raises(TimeoutError):  # 1000 tokens take the fake 30 s; give up after 0.5 s
        request(base, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 1000, "n": 3}, timeout=0.5)
    rid = worker.messages("generate")[0].request_id
    children = {child_request_id(rid, i) for i in range(3)}
    wait_for(lambda: children <= {m.request_id for m in worker.messages("abort")}, 5, "every child aborted")
    wait_for(lambda: router.in_flight == 0, 5, "the request ended")


@pytest.mark.timeout(60)
def test_a_stop_string_ends_its_sequence_alone(served) -> None:
    base, router, worker = served
    stop = router.tokenizer.decode([BASE + 1])
    assert stop.strip() and all(stop not in router.tokenizer.decode([BASE + i]) for i in (0, 2))
    status, out = request(base, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 5, "n": 3, "stop": [stop]})
    assert status == 200, out
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "stop", "length"]
    assert out["choices"][1]["text"] == ""
    rid = worker.messages("generate")[0].request_id
    assert [m.request_id for m in worker.messages("abort")] == [child_request_id(rid, 1)]  # it alone


@pytest.mark.timeout(60)
def test_a_rejected_sequence_fails_the_request_and_aborts_the_others(served) -> None:
    base, router, worker = served
    worker.reject_child = 1
    status, out = request(base, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 50, "n": 3})
    assert status == 400 and out["error"]["message"] == "no good" and out["error"]["param"] == "prompt"
    rid = worker.messages("generate")[0].request_id
    wait_for(lambda: {child_request_id(rid, i) for i in (0, 2)} <= {m.request_id for m in worker.messages("abort")},
             5, "the other sequences aborted")


@pytest.mark.timeout(60)
def test_a_workers_refusal_of_a_chat_prompt_names_messages(served) -> None:
    """A decode worker names the prompt "prompt" (e.g. too long for its KV pool); a chat
    client sent it as messages."""
    base, _, worker = served
    worker.reject_child = 0
    status, out = request(base, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                                  "max_tokens": 5, "n": 2})
    assert status == 400 and out["error"]["message"] == "no good" and out["error"]["param"] == "messages"


@pytest.mark.timeout(60)
def test_a_streams_headers_go_out_at_admission_before_its_first_token(served) -> None:
    base, router, worker = served
    worker.hold.set()  # as a long prefill would: no token for a while
    start = time.monotonic()
    response = open_request(base, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}, timeout=5)
    assert response.status == 200 and response.getheader("x-pdserve-decode-worker") == "decode-0"
    assert response.getheader("content-type").startswith("text/event-stream")
    assert time.monotonic() - start < 5
    wait_for(lambda: len(worker.messages("generate")) == 1, 2, "the worker has the request (sent before the headers)")
    worker.hold.clear()
    events = [line for line in response if line.startswith(b"data: ")]
    assert events[-1].strip() == b"data: [DONE]" and len(events) == 3


@pytest.mark.timeout(60)
def test_a_streams_worker_refusal_after_its_headers_is_an_error_event(served) -> None:
    base, router, worker = served
    worker.reject_child = 0
    response = open_request(base, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "stream": True},
                            timeout=20)
    assert response.status == 200
    events = [line[6:].strip() for line in response if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and json.loads(events[0])["error"]["param"] == "prompt" and len(events) == 2
    assert b'pdserve_requests_rejected_total{status="400"} 1.0' in router.metrics.render()


def test_a_keys_tokens_in_flight_count_every_sequence() -> None:
    class Settings:
        key_requests_per_s = key_burst = None
        key_tokens_in_flight = 100

    limits = Limits(Settings())
    lease = limits.lease(None, 3 * 10, 20, 3)  # 3 sequences of a 10-token prompt, max_tokens 20 each
    assert limits.in_flight(None) == 90
    limits.release(lease)
    with pytest.raises(APIError, match=r"prompt \(40 tokens\) \+ 4 sequences x max_tokens \(20\) = 120") as exc:
        limits.lease(None, 4 * 10, 20, 4)
    assert exc.value.status == 400 and exc.value.param == "max_tokens"
