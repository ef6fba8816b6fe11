"""The chaos run's hostile input (benchmarks/chaos/run.py): a corpus of bad request bodies
for the router, and a forger that talks to worker sockets as an unauthenticated peer.

Bad input must be answered with a 4xx naming the problem, never a 5xx. A worker must
never act on a message from a peer that has not proved it belongs to the deployment:
the forger sends a well-formed `Generate` and `Stats` (protocol/) from a plain ZMQ
DEALER, and any reply at all means the worker acted on it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass

from benchmarks.chaos.deploy import auth_headers
from benchmarks.chaos.load import Outcome, post_retrying

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TEN_MB = 10 * 2**20
USER = '[{"role": "user", "content": "hi"}]'


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def corpus() -> list[tuple[str, str, bytes]]:
    """(case name, path, body): every one is bad input."""
    cases: list[tuple[str, str, str | bytes]] = [
        # not a JSON object
        ("empty body", CHAT, b""),
        ("truncated JSON", CHAT, '{"messages": [{"role": "user"'),
        ("JSON null", CHAT, "null"),
        ("JSON array", COMPLETIONS, "[1, 2, 3]"),
        ("JSON string", COMPLETIONS, '"prompt"'),
        ("NaN literal", COMPLETIONS, '{"prompt": "hi", "temperature": NaN}'),
        ("Infinity literal", COMPLETIONS, '{"prompt": "hi", "top_p": -Infinity}'),
        # wrong types
        ("messages is a string", CHAT, '{"messages": "hi"}'),
        ("messages of numbers", CHAT, '{"messages": [1, 2]}'),
        ("content is a number", CHAT, '{"messages": [{"role": "user", "content": 5}]}'),
        ("role is a list", CHAT, '{"messages": [{"role": ["user"], "content": "hi"}]}'),
        ("max_tokens is a string", CHAT, f'{{"messages": {USER}, "max_tokens": "10"}}'),
        ("stream is a string", CHAT, f'{{"messages": {USER}, "stream": "yes"}}'),
        ("temperature is an object", COMPLETIONS, '{"prompt": "hi", "temperature": {}}'),
        ("prompt is an object", COMPLETIONS, '{"prompt": {"text": "hi"}}'),
        ("prompt nested lists", COMPLETIONS, '{"prompt": [[[1]]]}'),
        ("stop is a number", COMPLETIONS, '{"prompt": "hi", "stop": 5}'),
        ("model is a number", COMPLETIONS, '{"prompt": "hi", "model": 123}'),
        ("logprobs is a string", COMPLETIONS, '{"prompt": "hi", "logprobs": "x"}'),
        ("seed is a float", COMPLETIONS, '{"prompt": "hi", "seed": 1.5}'),
        ("response_format is a list", CHAT, f'{{"messages": {USER}, "response_format": []}}'),
        ("tools is a string", CHAT, f'{{"messages": {USER}, "tools": "all"}}'),
        # huge and out-of-range numbers
        ("max_tokens 10^30", CHAT, f'{{"messages": {USER}, "max_tokens": {10**30}}}'),
        ("max_tokens negative", COMPLETIONS, '{"prompt": "hi", "max_tokens": -1}'),
        ("temperature -1e308", COMPLETIONS, '{"prompt": "hi", "temperature": -1e308}'),
        ("top_p 1e400", COMPLETIONS, '{"prompt": "hi", "top_p": 1e400}'),
        ("token id 10^20", COMPLETIONS, f'{{"prompt": [{10**20}]}}'),
        ("token id negative", COMPLETIONS, '{"prompt": [-5]}'),
        ("seed 2^70", COMPLETIONS, f'{{"prompt": "hi", "seed": {2**70}}}'),
        ("n 10^20", COMPLETIONS, f'{{"prompt": "hi", "n": {10**20}}}'),
        ("top_logprobs 10^6", CHAT, f'{{"messages": {USER}, "logprobs": true, "top_logprobs": 1000000}}'),
        ("logprobs 10^9", COMPLETIONS, '{"prompt": "hi", "logprobs": 1000000000}'),
        ("top_k 10^30", COMPLETIONS, f'{{"prompt": "hi", "top_k": {10**30}}}'),
        ("min_tokens over max_tokens", COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "min_tokens": 1000000}'),
        ("repetition_penalty 0", COMPLETIONS, '{"prompt": "hi", "repetition_penalty": 0}'),
        # deeply nested JSON
        ("nested 100k in messages", CHAT, f'{{"messages": {_nested(100_000)}}}'),
        ("nested 100k in prompt", COMPLETIONS, f'{{"prompt": {_nested(100_000)}}}'),
        ("nested 100k in an unknown field", COMPLETIONS, f'{{"prompt": "hi", "x": {_nested(100_000)}}}'),
        ("nested 100k objects", CHAT, '{"a":' * 100_000 + "1" + "}" * 100_000),
        ("nested 1k in content", CHAT, f'{{"messages": [{{"role": "user", "content": {_nested(1000)}}}]}}'),
        ("nested 1k in a tool schema", CHAT, f'{{"messages": {USER}, "tools": [{{"type": "function", '
         f'"function": {{"name": "f", "parameters": ' + '{"type": "array", "items": ' * 1000 + '{"type": "string"}'
         + "}" * 1000 + "}}]}"),
        # invalid UTF-8 and unpaired surrogates
        ("invalid UTF-8 in content", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}'),
        ("invalid UTF-8 in a key", COMPLETIONS, b'{"pr\xffompt": "hi"}'),
        ("lone surrogate escape", COMPLETIONS, '{"prompt": "\\ud800 hi"}'),
        ("lone surrogate in stop", COMPLETIONS, '{"prompt": "hi", "stop": ["\\udfff"]}'),
        ("NUL bytes", CHAT, b'{"messages": [{"role": "user", "content": "a\x00b"}]}'),
        # 10 MB bodies
        ("10 MB prompt", COMPLETIONS, '{"prompt": "' + "a" * TEN_MB + '"}'),
        ("10 MB of messages", CHAT, '{"messages": [' + ",".join([
            '{"role": "user", "content": "hi"}'] * (TEN_MB // 34)) + "]}"),
        ("10 MB stop list", COMPLETIONS, '{"prompt": "hi", "stop": [' + ",".join(['"stop"'] * (TEN_MB // 7)) + "]}"),
        ("10 MB of whitespace", CHAT, " " * TEN_MB),
        ("10 MB not JSON", CHAT, b"\x00" * TEN_MB),
        ("10 MB token ids", COMPLETIONS, '{"prompt": [' + ",".join(["1"] * (TEN_MB // 2)) + "]}"),
        # pathological constraints
        ("unbalanced regex", COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "structured_outputs": {"regex": "("}}'),
        ("regex 10k alternations", COMPLETIONS, '{"prompt": "hi", "max_tokens": 4, "structured_outputs": '
         '{"regex": "' + "(a|" * 10_000 + "b" + ")" * 10_000 + '"}}'),
        ("schema not a schema", CHAT, f'{{"messages": {USER}, "response_format": {{"type": "json_schema", '
         '"json_schema": {"name": "x", "schema": {"type": 7}}}}'),
    ]
    return [(name, path, body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass"))
            for name, path, body in cases]


def send_cases(port: int, cases: list[tuple[str, str, bytes]], api_key: str | None, timeout_s: float = 60.0,
               retry_429_s: float = 30.0) -> list[Outcome]:
    """Each case in turn; a 429 (a full queue: the body was not judged) is retried."""
    out = []
    for name, path, body in cases:
        start = time.monotonic()
        cause, status, tokens, detail, attempts = post_retrying(port, path, body, auth_headers(api_key), timeout_s,
                                                                False, retry_429_s)
        out.append(Outcome("fuzz", name, start, time.monotonic(), cause, status, False, tokens, attempts, detail))
    return out


@dataclass
class Forgery:
    at: float
    worker: str
    address: str
    message: str  # "generate" or "stats"
    replies: list[str]  # the kinds of every message that came back

    @property
    def acted_on(self) -> bool:
        return bool(self.replies)

    def to_json(self) -> dict:
        return {**asdict(self), "acted_on": self.acted_on}


def forge(targets: dict[str, str], generate_to: set[str], wait_s: float = 10.0) -> list[Forgery]:
    """To each worker (name -> ZMQ address), as a stranger: a `Stats`, and to those in
    generate_to (decode workers) a one-token `Generate`, each from a socket of its own.
    Whatever comes back within wait_s (a busy worker answers late) is recorded."""
    import zmq

    from engine.sampling_params import SamplingParams
    from protocol import WORKER_MESSAGES, Generate, MessageError, Stats, encode, to_wire

    ctx = zmq.Context.instance()
    sent: list[tuple[zmq.Socket, Forgery]] = []
    poller = zmq.Poller()
    try:
        for worker, address in targets.items():
            messages = [("stats", Stats(seq=424242))]
            if worker in generate_to:
                messages.append(("generate", Generate(request_id=f"forged-{uuid.uuid4().hex}", prompt=[1, 2, 3],
                                                      params=to_wire(SamplingParams(max_tokens=1)), remote=False)))
            for kind, message in messages:
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.ROUTING_ID, f"forger-{uuid.uuid4().hex[:8]}".encode())
                sent.append((sock, Forgery(time.monotonic(), worker, address, kind, [])))
                poller.register(sock, zmq.POLLIN)
                sock.connect(address)
                sock.send(encode(message))
        forgeries = {sock: forgery for sock, forgery in sent}
        end = time.monotonic() + wait_s
        while (left := end - time.monotonic()) > 0:
            for sock, _ in poller.poll(int(left * 1000)):
                data = sock.recv()
                try:
                    forgeries[sock].replies.append(WORKER_MESSAGES.decode(data).kind)
                except MessageError:
                    forgeries[sock].replies.append(f"undecodable ({len(data)} bytes)")
    finally:
        for sock, _ in sent:
            sock.close()
    return [forgery for _, forgery in sent]
