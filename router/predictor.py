"""The router's latency predictor: for a request and a candidate decode worker, its time
to first token (TTFT) and time per output token (TPOT) if sent there now.

TTFT = (prefill tokens queued ahead of it + its own uncached tokens) / prefill
throughput, + the KV transfer (remote prefill), + one step of the decode worker at the
batch it would join. "Ahead" follows the queues' order (priority, then fair-queuing tag,
then arrival: router/fair_queue.py), over the requests the router has submitted whose
first token has not come yet: on that worker for a local prefill, across the decode
pool for a remote one (any prefill worker may take it). Throughput is what the workers
report (their stats replies' step time per step size, protocol/stats.py StepTimes): a
local prefill runs at the decode worker's rate in its largest steps, a remote one at the
prefill pool's summed rate. The transfer costs seconds per prompt token, learned from
finished requests' kv_write phases (the writes compute did not hide; their transfer
phase also holds the prefill worker's wait for the step it was in: queueing, which
"ahead" already counts).

TPOT = the decode worker's mean step time at the batch the request would make (every
sequence the router has on it, plus the request's own), interpolated between its
measured batch sizes and extrapolated along the last slope.

Each prediction is then scaled by a correction learned online, per worker and
prefill placement: the running mean, in log space, of actual / predicted over the
requests that completed, fading back to 1 with a half-life of HALF_LIFE_S without a
completion (what a burst taught must not outlive it). Its own error (|actual - predicted|, seconds) goes to
pdserve_slo_prediction_error_seconds and to /status (p50, p90 of the recent ones).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from protocol import StepTimes, WorkerStats, mean_points

ALPHA = 0.2  # weight of the newest completion in a correction
MAX_LOG_CORRECTION = math.log(8.0)  # a correction stays within 1/8 .. 8x
RECENT = 1000  # errors kept for /status's quantiles
HALF_LIFE_S = 30.0  # a correction fades back to 1 with this half-life without completions
LARGE_STEPS = 0.5  # a worker's prefill rate: from its steps of at least this share of its largest mean step size
# A decode worker's steps of fewer tokens than this may be decode steps alone (a batch of
# up to 256 sequences), whose rows cost more per token than a prefill's: its prefill rate
# is taken from larger ones, else from the prefill pool's, else from its largest.
MIN_PREFILL_STEP = 256


@dataclass(eq=False)
class Ticket:
    """One submission of a prompt to a decode worker, from submit to its last sequence's
    end: what the predictor counts as queued ahead, and what it learns from."""

    worker: str
    remote: bool
    order: tuple[int, float]  # (priority, fair-queuing tag): the queues' order
    tokens: int  # uncached prompt tokens: its prefill work
    sequences: int  # params.n: rows it adds to the decode batch
    submitted: float  # time.monotonic()
    ttft_s: float | None = None  # predicted; None: no figures yet
    tpot_s: float | None = None
    raw_ttft: float | None = None  # before the correction (what the correction learns against)
    raw_tpot: float | None = None
    first_at: float | None = None  # its first token came (its prefill no longer queues)
    open: int = 0  # sequences not ended
    client: int | None = None  # its API key's position (router/key_shares.py); the predictor ignores it


@dataclass(frozen=True)
class Prediction:
    ttft_s: float | None
    tpot_s: float | None
    raw_ttft: float | None
    raw_tpot: float | None
    batch: int = 0  # sequences on the worker with the request's own (its TPOT's batch)


def prefill_rate(t: StepTimes | None, min_size: float = 0.0) -> float | None:
    """Prompt tokens per second in a worker's largest steps (its prefills), among those
    of at least `min_size` tokens on average; None before any."""
    if t is None:
        return None
    points = [(size, seconds) for size, seconds in mean_points(t) if seconds > 0 and size >= min_size]
    if not points:
        return None
    largest = max(size for size, _ in points)
    big = [(s, sec) for s, sec in points if s >= LARGE_STEPS * largest]
    return sum(s for s, _ in big) / sum(sec for _, sec in big)


def step_seconds(t: StepTimes | None, batch: float) -> float | None:
    """A worker's mean step time at `batch` requests per step (None before any step):
    interpolated between the batch sizes it measured, along the last slope past them,
    and flat beyond a single one (no slope to follow yet: the correction learns it)."""
    if t is None:
        return None
    points: list[tuple[float, float]] = []
    for x, y in mean_points(t):
        if not points or x > points[-1][0]:  # two buckets with one mean size: keep the first
            points.append((x, y))
    if not points:
        return None
    if batch <= points[0][0] or len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if batch <= x1:
            return y0 + (y1 - y0) * (batch - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (batch - x1)


class _Correction:
    """A multiplicative correction: a running mean, in log space, of actual / predicted,
    fading back to 1 (the figures as reported) with a half-life of HALF_LIFE_S without
    a completion. Load the figures do not show (a busy host's contention) inflates it;
    once that load is gone, so must it: under policy reject an over-predicted request is
    refused and teaches nothing, so a correction that never faded would refuse an idle
    server's requests for good."""

    def __init__(self) -> None:
        self.log = 0.0
        self.n = 0
        self.stamp = 0.0  # time.monotonic() of its last completion

    def factor(self, now: float) -> float:
        return math.exp(self._faded(now))

    def _faded(self, now: float) -> float:
        return self.log * 0.5 ** (max(0.0, now - self.stamp) / HALF_LIFE_S) if self.n else 0.0

    def learn(self, actual: float, predicted: float, now: float) -> None:
        if actual <= 0 or predicted <= 0:
            return
        x = max(-MAX_LOG_CORRECTION, min(MAX_LOG_CORRECTION, math.log(actual / predicted)))
        self.log = self._faded(now)
        self.n += 1
        self.stamp = now
        self.log += (x - self.log) * max(ALPHA, 1 / self.n)  # the plain mean until 1/n < ALPHA


class LatencyPredictor:
    """Who calls what: the router's pool hands it every stats reply (update); the router
    asks predict() per candidate and submits a Ticket (track); a request's sequences
    report first_token() and ended(); finished requests' phases feed transfer()."""

    def __init__(self, on_error: Callable[[str, bool, float], None] | None = None) -> None:
        """on_error(target, remote, |actual - predicted|): the metrics' histogram."""
        self.stats: dict[tuple[str, str], WorkerStats] = {}  # (role, name) -> its latest reply
        self.tickets: set[Ticket] = set()
        self._ttft: dict[tuple[str, bool], _Correction] = {}
        self._tpot: dict[str, _Correction] = {}
        self.transfer_s_per_token: float | None = None  # a moving mean; None until a remote prefill finished
        self.errors: dict[str, deque[float]] = {"ttft": deque(maxlen=RECENT), "tpot": deque(maxlen=RECENT)}
        self.on_error = on_error

    # --- what the workers report -----------------------------------------------------

    def update(self, role: str, name: str, stats: WorkerStats) -> None:
        self.stats[(role, name)] = stats

    def forget(self, role: str, name: str) -> None:
        """The worker left its pool: its figures and corrections go."""
        self.stats.pop((role, name), None)
        self._tpot.pop(name, None)
        for remote in (False, True):
            self._ttft.pop((name, remote), None)

    def transfer(self, seconds: float, prompt_tokens: int) -> None:
        """A remote prefill's kv_write phase (its KV hop), for the seconds per token."""
        if prompt_tokens > 0 and math.isfinite(seconds) and seconds >= 0:  # a worker's figure: never trusted blindly
            per_token, mean = seconds / prompt_tokens, self.transfer_s_per_token
            self.transfer_s_per_token = per_token if mean is None else mean + ALPHA * (per_token - mean)

    # --- predicting ------------------------------------------------------------------

    def predict(self, worker: str, tokens: int, remote: bool, order: tuple[int, float], sequences: int,
                prefill_workers: Iterable[str]) -> Prediction:
        """TTFT and TPOT of a request sent to `worker` now (module doc); None where the
        workers have not reported the figures yet. `prefill_workers`: the live ones. A
        decode worker with no figures of its own yet (just started) is predicted from
        another's: the pool's workers serve one model on like hardware."""
        decode = self._figures(worker)
        batch = sequences + sum(t.open for t in self.tickets if t.worker == worker)
        step = step_seconds(decode.step_seconds_by_requests if decode else None, batch)
        ahead = sum(t.tokens for t in self.tickets if t.first_at is None and t.remote == remote
                    and (remote or t.worker == worker) and t.order <= order)
        pool = self._prefill_pool_rate(prefill_workers)
        own = decode.step_seconds_by_tokens if decode else None
        # The best figure at hand first: a worker's own prefills, else the other pool's
        # (one model), else its largest steps whatever they were (short prompts alone).
        own_large, own_any = prefill_rate(own, MIN_PREFILL_STEP), prefill_rate(own)
        if remote:
            rate = pool or own_large or own_any
            hop = tokens * (self.transfer_s_per_token or 0.0)
        else:
            rate = own_large or pool or own_any
            hop = 0.0
        raw_ttft = (ahead + tokens) / rate + hop + (step or 0.0) if rate else None
        now = time.monotonic()
        ttft = raw_ttft * self._ttft.get((worker, remote), _Correction()).factor(now) if raw_ttft is not None else None
        tpot = step * self._tpot_factor(worker, now) if step is not None else None
        return Prediction(ttft, tpot, raw_ttft, step, batch)

    def tpot_at(self, worker: str, batch: int, corrected: bool = True) -> float | None:
        """The TPOT predicted on `worker` at a batch of `batch` sequences, corrected as
        predict()'s (or the step time as measured: corrected False); None before any
        figures."""
        decode = self._figures(worker)
        step = step_seconds(decode.step_seconds_by_requests if decode else None, batch)
        if step is None or not corrected:
            return step
        return step * self._tpot_factor(worker, time.monotonic())

    def _tpot_factor(self, worker: str, now: float) -> float:
        return self._tpot.get(worker, _Correction()).factor(now)

    def _figures(self, worker: str) -> WorkerStats | None:
        own = self.stats.get(("decode", worker))
        if own is not None and own.step_seconds_by_requests is not None and any(own.step_seconds_by_requests.counts):
            return own
        return next((s for (role, _), s in sorted(self.stats.items()) if role == "decode"
                     and s.step_seconds_by_requests is not None and any(s.step_seconds_by_requests.counts)), own)

    def _prefill_pool_rate(self, prefill_workers: Iterable[str]) -> float | None:
        rates = [prefill_rate(s.step_seconds_by_tokens) for name in prefill_workers
                 if (s := self.stats.get(("prefill", name))) is not None]
        return sum(r for r in rates if r) or None

    # --- a submitted request's life --------------------------------------------------

    def track(self, ticket: Ticket) -> None:
        ticket.open = ticket.sequences
        self.tickets.add(ticket)

    def first_token(self, ticket: Ticket, now: float | None = None) -> None:
        """The ticket's first token came: its prefill no longer queues; learn its TTFT."""
        if ticket.first_at is not None:
            return
        ticket.first_at = now = time.monotonic() if now is None else now
        actual = now - ticket.submitted
        if ticket.raw_ttft is not None:
            self._ttft.setdefault((ticket.worker, ticket.remote), _Correction()).learn(actual, ticket.raw_ttft, now)
        if ticket.ttft_s is not None:
            self._error("ttft", ticket.remote, abs(actual - ticket.ttft_s))

    def ended(self, ticket: Ticket, tpot_s: float | None) -> None:
        """One of its sequences ended (tpot_s: its TPOT, None if under two tokens or it
        did not finish); the ticket goes with its last."""
        if tpot_s is not None and ticket.raw_tpot is not None:
            self._tpot.setdefault(ticket.worker, _Correction()).learn(tpot_s, ticket.raw_tpot, time.monotonic())
            if ticket.tpot_s is not None:
                self._error("tpot", ticket.remote, abs(tpot_s - ticket.tpot_s))
        ticket.open -= 1
        if ticket.open <= 0:
            self.tickets.discard(ticket)

    def _error(self, target: str, remote: bool, error: float) -> None:
        self.errors[target].append(error)
        if self.on_error is not None:
            self.on_error(target, remote, error)

    def error_quantiles(self, last: int | None = None) -> dict[str, dict[str, float | int | None]]:
        """p50 and p90 of the recent absolute errors, seconds, per target (/status): the
        last RECENT, or the last `last` of those."""
        out: dict[str, dict[str, float | int | None]] = {}
        for target, errors in self.errors.items():
            ranked = sorted(list(errors)[-last:] if last is not None else errors)
            out[target] = {"p50_s": _quantile(ranked, 0.5), "p90_s": _quantile(ranked, 0.9), "n": len(ranked)}
        return out


def _quantile(ranked: list[float], q: float) -> float | None:
    if not ranked:
        return None
    return ranked[min(len(ranked) - 1, int(q * len(ranked)))]
