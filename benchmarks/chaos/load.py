"""The chaos run's clients (benchmarks/chaos/run.py): one HTTP request and how it ended,
steady Poisson load through the router (streamed and not, chat and completions, some
dropped by the client on purpose), and a flood past the router's queue bound.

Causes a request can end with (Outcome.cause):
    ok              a 200 whose body (or stream, to its [DONE]) is complete
    http_<status>   an HTTP error status (429 after the load client's retries)
    broken_stream   a stream that began (200) but carried an error event or ended
                    without [DONE]
    connect_error   no status line: refused, reset, or closed before an answer
    timeout         no answer within the client's timeout
    dropped         the client hung up on purpose (mid-stream, or before the answer)
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import asdict, dataclass

from benchmarks.chaos.deploy import auth_headers

WORDS = ("river stone apple quiet engine harbor violet seven lantern copper meadow signal orbit "
         "garden marble pencil thunder window falcon silver bridge candle winter ocean planet").split()


@dataclass
class Outcome:
    kind: str  # "load", "flood" or "fuzz"
    name: str  # the fuzz case, or the request's shape ("chat/stream", ...)
    start: float  # time.monotonic()
    end: float
    cause: str  # see the module docstring
    status: int | None = None
    stream: bool = False
    tokens: int = 0  # streamed content events, or completion_tokens
    attempts: int = 1  # 429s retried by the load client count here
    detail: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def post(port: int, path: str, body: bytes, headers: dict[str, str], timeout: float, stream: bool,
         drop_after: int | None = None, drop_delay_s: float | None = None) -> tuple[str, int | None, int, str]:
    """POST body; (cause, status, tokens, detail). drop_after: hang up after that many
    stream events; drop_delay_s: hang up that long after sending (no answer read)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    status = None
    try:
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json", **headers})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer (413) before reading a large body
        if drop_delay_s is not None:
            time.sleep(drop_delay_s)
            return "dropped", None, 0, ""
        response = conn.getresponse()
        status = response.status
        if status != 200 or not stream:
            data = response.read()
            if status != 200:
                return f"http_{status}", status, 0, data[:200].decode(errors="replace")
            usage = json.loads(data).get("usage") or {}
            return "ok", status, usage.get("completion_tokens", 0), ""
        events = 0
        while True:
            line = response.readline()
            if not line:
                return "broken_stream", status, events, "ended without [DONE]"
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                return "ok", status, events, ""
            if b'"error"' in payload and "error" in json.loads(payload):
                return "broken_stream", status, events, payload[:200].decode(errors="replace")
            events += 1
            if drop_after is not None and events >= drop_after:
                return "dropped", status, events, ""
    except TimeoutError:
        return "timeout", status, 0, ""
    except (ConnectionError, http.client.HTTPException, OSError) as exc:
        return ("broken_stream" if status == 200 and stream else "connect_error"), status, 0, repr(exc)[:200]
    finally:
        conn.close()  # a drop: the router sees the connection go


def post_retrying(port: int, path: str, body: bytes, headers: dict[str, str], timeout: float, stream: bool,
                  retry_429_s: float, drop_after: int | None = None,
                  drop_delay_s: float | None = None) -> tuple[str, int | None, int, str, int]:
    """post(), a 429 retried after the router's Retry-After (1 s) until retry_429_s has
    passed; the last answer, and the number of attempts."""
    end, attempts = time.monotonic() + retry_429_s, 0
    while True:
        attempts += 1
        cause, status, tokens, detail = post(port, path, body, headers, timeout, stream, drop_after, drop_delay_s)
        if cause != "http_429" or time.monotonic() + 1.0 > end:
            return cause, status, tokens, detail, attempts
        time.sleep(1.0)


def _prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(n_words))


@dataclass
class LoadShape:
    rate: float = 0.5  # requests per second (Poisson)
    max_tokens: tuple[int, int] = (4, 12)
    prompt_words: tuple[int, int] = (3, 40)
    stream_share: float = 0.5
    chat_share: float = 0.5
    drop_share: float = 0.1  # requests the client abandons on purpose
    timeout_s: float = 90.0
    retry_429_s: float = 30.0  # a 429 is retried after its Retry-After for this long, as clients do


class Load:
    """Steady Poisson load until stop(); each request in its own thread."""

    def __init__(self, port: int, seed: int, shape: LoadShape, api_key: str | None) -> None:
        self.port, self.shape, self.headers = port, shape, auth_headers(api_key)
        self.rng = random.Random(seed)
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._main = threading.Thread(target=self._run, name="chaos-load", daemon=True)

    def start(self) -> None:
        self._main.start()

    def stop(self, timeout: float) -> int:
        """Stop sending; wait for requests in flight. The number still running after timeout."""
        self._stop.set()
        self._main.join()
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        return sum(t.is_alive() for t in self._threads)

    def _run(self) -> None:
        index = 0
        while not self._stop.wait(self.rng.expovariate(self.shape.rate)):
            t = threading.Thread(target=self._one, args=(random.Random(self.rng.random()), index), daemon=True)
            index += 1
            self._threads.append(t)
            t.start()

    def _one(self, rng: random.Random, index: int) -> None:
        s = self.shape
        chat, stream = rng.random() < s.chat_share, rng.random() < s.stream_share
        body: dict = {"max_tokens": rng.randint(*s.max_tokens), "stream": stream, "temperature": 0.7,
                      "seed": index}
        text = _prompt(rng, rng.randint(*s.prompt_words))
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        drop_after = drop_delay = None
        if rng.random() < s.drop_share:
            if stream:
                drop_after = rng.randint(1, 3)
            else:
                drop_delay = rng.uniform(0.1, 1.0)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        start = time.monotonic()
        cause, status, tokens, detail, attempts = post_retrying(
            self.port, path, json.dumps(body).encode(), self.headers, s.timeout_s, stream, s.retry_429_s,
            drop_after, drop_delay)
        outcome = Outcome("load", f"{'chat' if chat else 'completion'}/{'stream' if stream else 'whole'}", start,
                          time.monotonic(), cause, status, stream, tokens, attempts, detail)
        with self._lock:
            self.outcomes.append(outcome)


def flood(port: int, size: int, api_key: str | None, timeout_s: float = 90.0) -> list[Outcome]:
    """`size` short requests at once, past the router's queue bound: each is served or
    answered 429; the caller judges anything else."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    body = json.dumps({"prompt": "flood " * 4, "max_tokens": 2}).encode()
    go = threading.Event()

    def one() -> None:
        go.wait()
        start = time.monotonic()
        cause, status, tokens, detail = post(port, "/v1/completions", body, auth_headers(api_key), timeout_s, False)
        with lock:
            outcomes.append(Outcome("flood", "flood", start, time.monotonic(), cause, status, False, tokens,
                                    detail=detail))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(size)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(timeout_s + 10)
    return outcomes
