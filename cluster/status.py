"""`pdserve status`: a running deployment's workers, as its router sees them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import msgspec

from protocol import WorkerStats
from workers.step_metrics import histogram_quantile

Cell = Callable[[WorkerStats], str]  # a worker's stats -> what its column shows ("?": not its role's)


def _figure(field: str) -> Cell:
    def cell(s: WorkerStats) -> str:
        value = getattr(s, field)
        return "?" if value is None else str(value)
    return cell


def _kv_used(s: WorkerStats) -> str:
    """Blocks not free / all blocks."""
    # One decimal: a few requests' blocks in a large pool are well under 1%, not 0.
    return f"{s.kv_used:.1%}" if s.num_blocks else "?"


def _step_p50(s: WorkerStats) -> str:
    """The median engine step, from the worker's step-time histogram ("-": no step yet)."""
    p50 = histogram_quantile(s.step_seconds, 0.5)
    return "-" if p50 is None else f"{p50 * 1e3:.1f}ms"


def _mean_batch(s: WorkerStats) -> str:
    """Requests per engine step, on average."""
    hist = s.step_requests
    return f"{hist.sum / hist.count:.1f}" if hist.count else "-"


def _tiers(s: WorkerStats) -> str:
    """Each KV offload tier's used/capacity blocks and hits, e.g. host:120/1456+34
    ("-": no tiers). The shared tier's capacity is the whole store's, its used blocks
    those of this worker's configuration."""
    if s.kv_tiers is None:
        return "-"
    return ",".join(f"{t.name}:{t.used_blocks}/{t.capacity_blocks}+{t.hits}" for t in s.kv_tiers.tiers)


DECODE_COLUMNS: tuple[tuple[str, Cell], ...] = (
    ("running", _figure("running")), ("waiting", _figure("waiting")), ("waiting_kv", _figure("waiting_for_kv")),
    ("kv_used", _kv_used), ("remote", _figure("remote")), ("local", _figure("local")),
    ("fallbacks", _figure("fallbacks")), ("fenced", _figure("quarantined_blocks")), ("step_p50", _step_p50),
    ("batch", _mean_batch), ("preempted", _figure("preemptions")), ("kv_tiers", _tiers))
PREFILL_COLUMNS: tuple[tuple[str, Cell], ...] = (
    ("jobs", _figure("jobs")), ("kv_used", _kv_used), ("prefills", _figure("prefills")),
    ("blocks_sent", _figure("blocks_written")), ("failed", _figure("failed")),
    ("tokens", _figure("tokens_computed")), ("running", _figure("running")), ("waiting", _figure("waiting")),
    ("step_p50", _step_p50), ("batch", _mean_batch), ("preempted", _figure("preemptions")), ("kv_tiers", _tiers))

def fetch_status(url: str, timeout: float = 10.0, api_key: str | None = None) -> dict[str, Any]:
    """GET {url}/status (url: the router's base, e.g. http://127.0.0.1:8000, or the API's
    that `pdserve serve` prints, ending in /v1), with `Authorization: Bearer api_key`
    when given. PermissionError if the router refuses the key (or asks for one)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    status_url = f"{url.rstrip('/').removesuffix('/v1')}/status"
    try:
        with urllib.request.urlopen(urllib.request.Request(status_url, headers=headers), timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            what = "refused the API key" if api_key else "needs an API key"
            raise PermissionError(f"the router at {url} {what} (401): set PDSERVE_API_KEY or pass --api-key") from None
        raise ConnectionError(f"the router at {url} answered {exc.code} to /status") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ConnectionError(f"no pdserve router answers at {url}: {exc}") from None


def worker_stats(worker: dict[str, Any]) -> WorkerStats | None:
    """A /status row's stats (None: the worker never answered). ValueError naming the
    worker and the field when they are not a WorkerStats (a router of another version)."""
    if worker.get("stats") is None:
        return None
    try:
        return msgspec.convert(worker["stats"], WorkerStats)
    except msgspec.ValidationError as exc:
        raise ValueError(f"worker {worker.get('name')!r}: stats this pdserve cannot read "
                         f"(a router of another version?): {exc}") from None


def _ranks(stats: WorkerStats) -> str:
    """A tensor-parallel group is one worker: its size, then its ranks' process ids
    (rank 0 first), e.g. 2:4711,4712."""
    return f"{len(stats.ranks)}:{','.join(map(str, stats.ranks))}" if stats.ranks else "?"


def _stats_age(worker: dict[str, Any]) -> str:
    """How old the row's figures are: `0s` for a reply to this /status, more for an
    earlier reply's (a worker busy in a long step, or dead); `never` if none came."""
    if worker.get("stats") is None:
        return "never"
    return f"{worker.get('stats_age_s') or 0:.0f}s"  # a router of an earlier version has no age: fresh


def _table(title: str, workers: list[dict[str, Any]], columns: tuple[tuple[str, Cell], ...]) -> list[str]:
    header = ("worker", "live", "address", "stats_age", "tp", *(c for c, _ in columns))
    rows = []
    for w in workers:
        s = worker_stats(w)
        live = ("draining" if w.get("draining") else "yes") if w["live"] else "NO"  # draining: being scaled down
        cells = ["?"] * (len(columns) + 1) if s is None else [_ranks(s), *(cell(s) for _, cell in columns)]
        rows.append((w["name"], live, w.get("address", "?"), _stats_age(w), *cells))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(header)]
    return [title, "  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip()] + [
        "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_status(status: dict[str, Any]) -> str:
    """A table per pool, a row per worker (ValueError: worker_stats())."""
    lines = [f"model {status['model']}; requests in flight: {status['in_flight']}", ""]
    lines += _table("decode pool", status["decode_workers"], DECODE_COLUMNS)
    prefill = status.get("prefill_workers", [])
    lines += [""] + (_table("prefill pool", prefill, PREFILL_COLUMNS) if prefill else ["prefill pool: none"])
    if "slo" in status:  # a router of an earlier version has none
        lines += ["", _slo_line(status["slo"])]
    return "\n".join(lines)


def _slo_line(slo: dict[str, Any]) -> str:
    """The SLO policy and the latency predictor's recent absolute error, p50/p90 per
    target (router/predictor.py), e.g. `ttft error p50 12.0ms p90 40.1ms (n=230)`."""
    parts = [f"slo policy {slo.get('policy', '?')}"]
    for target, q in sorted((slo.get("prediction_error") or {}).items()):
        if not q.get("n"):
            parts.append(f"{target} error: no prediction yet")
            continue
        parts.append(f"{target} error p50 {q['p50_s'] * 1e3:.1f}ms p90 {q['p90_s'] * 1e3:.1f}ms (n={int(q['n'])})")
    return "; ".join(parts)
