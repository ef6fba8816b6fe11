"""benchmarks/serving/slo.py's requests: each carries its own SLO (body fields
slo_ttft_ms / slo_tpot_ms) and is judged against it by what the client measured, so
the router's own view of a request never decides whether it counts as good.

A trace is drawn from its seed alone (arrivals, lengths, SLO classes), so the fcfs and
slo arms see the same requests at the same times."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx2 as httpx

from benchmarks.serving.load import Result, Workload, _client, one_request
from benchmarks.serving.report import percentiles


@dataclass(frozen=True)
class SLOClass:
    """A request class's targets, milliseconds (None: no target for that latency)."""

    name: str
    ttft_ms: float | None
    tpot_ms: float | None

    def body(self) -> dict[str, float]:
        return {k: v for k, v in (("slo_ttft_ms", self.ttft_ms), ("slo_tpot_ms", self.tpot_ms)) if v is not None}


NO_SLO = SLOClass("none", None, None)


@dataclass
class Sent:
    """One request of a trace: when it goes out, what it asks, whose it is, and what
    the client saw (result)."""

    at: float  # seconds after the run's start
    prompt: list[int] | str
    slo: SLOClass
    result: Result
    key: str = ""  # a label (the API key's role, e.g. "quiet"), never the key itself
    done_at: float | None = None  # seconds after the run's start its answer ended

    @property
    def rejected(self) -> bool:
        return self.result.error.startswith("HTTP 429")

    @property
    def slo_rejected(self) -> bool:
        """A 429 of SLO admission (slo_unattainable, over_fair_share), not a full queue."""
        return self.rejection not in (None, "other")

    @property
    def rejection(self) -> str | None:
        """Why a 429 came, from its message: ttft, tpot (a predicted miss of that target),
        slo (a predicted miss, the target unnamed), share (over_fair_share), or other (a
        full queue, a rate limit); None: none came."""
        if not self.rejected:
            return None
        error = self.result.error
        return ("ttft" if "time-to-first-token" in error else "tpot" if "time-per-output-token" in error
                else "share" if "weighted share" in error else "slo" if "predicted to miss" in error else "other")

    @property
    def good(self) -> bool:
        """Completed and within both of its own targets, as the client measured them:
        TTFT from send to the first streamed token, TPOT = (e2e - ttft) / (tokens - 1)."""
        r = self.result
        if not r.ok:
            return False
        if self.slo.ttft_ms is not None and r.ttft * 1000 > self.slo.ttft_ms:
            return False
        return self.slo.tpot_ms is None or r.tpot is None or r.tpot * 1000 <= self.slo.tpot_ms


def draw_trace(workload: Workload, seed: int, rate: float | None, duration: float | None,
               classes: list[SLOClass], n: int | None = None, key: str = "") -> list[Sent]:
    """The trace for this seed: Workload's arrivals and lengths, then each request's
    class drawn uniformly from `classes` by a generator of its own (so the classes do
    not shift the arrivals, and a trace is the same whichever arm sends it)."""
    pick = random.Random(f"slo-class-{seed}")  # str seeds hash stably (sha512)
    return [Sent(t, prompt, pick.choice(classes), result, key)
            for t, prompt, result in workload.draw(n, seed, rate, duration)]


async def _send(client: httpx.AsyncClient, url: str, model: str, sent: Sent, start: float) -> None:
    extra = {**sent.slo.body(), "stream_options": {"include_usage": True}}
    try:
        await one_request(client, url, model, sent.prompt, sent.result, extra)
    except Exception as exc:  # a benchmark reports a failure (e.g. a malformed chunk), it does not stop on one
        sent.result.error = sent.result.error or f"{type(exc).__name__}: {exc}"
        sent.result.ok = False
    sent.done_at = time.perf_counter() - start


async def run_open_loop(url: str, model: str, trace: list[Sent],
                        keys: dict[str, str] | None = None) -> float:
    """Send each request at its arrival time whatever is in flight (Poisson, open loop),
    as the API key keys[sent.key] (no key where keys is None); wait for every answer.
    Returns the run's seconds: the first arrival to the last answer."""
    order = sorted(trace, key=lambda s: s.at)
    labels = sorted({s.key for s in order})
    clients = {label: _client((keys or {}).get(label)) for label in labels}
    try:
        start = time.perf_counter()
        tasks = []
        for sent in order:
            delay = start + sent.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_send(clients[sent.key], url, model, sent, start)))
        await asyncio.gather(*tasks)
        return time.perf_counter() - start
    finally:
        await asyncio.gather(*(c.aclose() for c in clients.values()))


async def run_closed_loop(url: str, model: str, trace: list[Sent], concurrency: int, seconds: float,
                          api_key: str | None = None) -> list[Sent]:
    """Keep `concurrency` requests outstanding, taken in trace order, for `seconds`:
    no new request after that, those in flight finish. Returns the requests sent, each
    with done_at (seconds from the start)."""
    queue = iter(trace)
    sent_list: list[Sent] = []
    async with _client(api_key) as client:
        start = time.perf_counter()

        async def sender() -> None:
            for sent in queue:  # one shared iterator: each request goes out once
                if time.perf_counter() - start >= seconds:
                    return
                sent_list.append(sent)
                await _send(client, url, model, sent, start)

        await asyncio.gather(*(sender() for _ in range(concurrency)))
    return sent_list


def steady_rate(sent: list[Sent], seconds: float, skip: float = 0.5) -> float:
    """Completed requests per second over the window's last (1 - skip) share: the first
    part is left out, where the closed loop's first requests all queue for prefill at
    once and none has finished yet (which would understate the rate)."""
    lo = seconds * skip
    done = [s for s in sent if s.result.ok and s.done_at is not None and lo <= s.done_at <= seconds]
    return len(done) / (seconds - lo)


def summarize(trace: list[Sent], elapsed: float, window: float | None = None) -> dict:
    """One run's figures. goodput is good requests per second of the arrival window
    (`window`, default `elapsed`): the same denominator for every arm given one trace,
    so arms compare by how many requests met their SLO. throughput is completed
    requests per second of the run (first arrival to last answer), so a backlog served
    late costs its seconds there."""
    ok = [s for s in trace if s.result.ok]
    by_class = {}
    for name in sorted({s.slo.name for s in trace}):
        mine = [s for s in trace if s.slo.name == name]
        by_class[name] = {"requests": len(mine), "good": sum(s.good for s in mine),
                          "rejected": sum(s.rejected for s in mine)}
    errors = sorted({s.result.error[:160] for s in trace if s.result.error and not s.rejected})
    return {
        "requests": len(trace), "completed": len(ok), "good": sum(s.good for s in trace),
        "rejected": sum(s.rejected for s in trace), "slo_rejected": sum(s.slo_rejected for s in trace),
        "rejected_by": dict(sorted(Counter(s.rejection for s in trace if s.rejection).items())),
        "failed": sum(not s.result.ok and not s.rejected for s in trace), "errors": errors[:5],
        "elapsed_s": elapsed,
        "window_s": window or elapsed,
        "goodput": sum(s.good for s in trace) / (window or elapsed) if (window or elapsed) > 0 else 0.0,
        "throughput": len(ok) / elapsed if elapsed > 0 else 0.0,
        "ttft": percentiles([s.result.ttft for s in ok]),
        "tpot": percentiles([s.result.tpot for s in ok if s.result.tpot is not None]),
        "classes": by_class,
    }


@dataclass
class Unloaded:
    """p50 TTFT and TPOT of requests sent one at a time, seconds."""

    ttft_s: float
    tpot_s: float
    samples: list[tuple[float, float | None]] = field(default_factory=list)

    @classmethod
    def of(cls, sent: list[Sent]) -> Unloaded:
        ok = [s.result for s in sent if s.result.ok]
        if not ok:
            raise RuntimeError(f"no unloaded request completed: {sorted({s.result.error for s in sent})[:3]}")
        tpots = [r.tpot for r in ok if r.tpot is not None]
        return cls(percentiles([r.ttft for r in ok])["p50"], percentiles(tpots)["p50"] if tpots else float("nan"),
                   [(r.ttft, r.tpot) for r in ok])
