"""One histogram of the router's /metrics, scraped before and after a run: the run's
own observations are the difference. Used for the KV transfer time per request
(pdserve_request_phase_seconds{phase="kv_write"}, and the whole hop, phase="transfer"),
which only the workers see.
Quantiles come from the bucket counts as Prometheus' histogram_quantile computes them
(linear within a bucket), so they are as coarse as the router's buckets."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import httpx2 as httpx

_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class Histogram:
    """A histogram summed over the label sets that matched: cumulative bucket counts by
    upper bound, the sum and the count."""
    buckets: dict[float, float] = field(default_factory=dict)
    sum: float = 0.0
    count: float = 0.0

    def minus(self, before: Histogram) -> Histogram:
        return Histogram({le: n - before.buckets.get(le, 0.0) for le, n in self.buckets.items()},
                         self.sum - before.sum, self.count - before.count)

    def quantile(self, q: float) -> float:
        """NaN without observations; the largest finite bound if q lands in +Inf."""
        if self.count <= 0:
            return math.nan
        rank, lower, below = q * self.count, 0.0, 0.0
        finite = sorted(le for le in self.buckets if le != math.inf)
        for le in finite:
            n = self.buckets[le]
            if n >= rank:
                return lower + (le - lower) * ((rank - below) / (n - below) if n > below else 1.0)
            lower, below = le, n
        return finite[-1] if finite else math.nan

    def summary(self) -> dict[str, float]:
        mean = self.sum / self.count if self.count > 0 else math.nan
        return {"count": self.count, "mean": mean, "p50": self.quantile(0.5), "p99": self.quantile(0.99)}


def parse_histogram(text: str, name: str, labels: dict[str, str]) -> Histogram:
    """`name`'s samples in a Prometheus text exposition whose labels include `labels`,
    summed over their other labels (e.g. prefill="remote" and "local")."""
    out = Histogram()
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or not m["name"].startswith(name):
            continue
        got = dict(_LABEL.findall(m["labels"] or ""))
        if any(got.get(k) != v for k, v in labels.items()):
            continue
        value = float(m["value"])
        suffix = m["name"][len(name):]
        if suffix == "_bucket":
            le = float(got["le"])  # "+Inf" parses as inf
            out.buckets[le] = out.buckets.get(le, 0.0) + value
        elif suffix == "_sum":
            out.sum += value
        elif suffix == "_count":
            out.count += value
    return out


# The KV transfer proper: computed -> last write acknowledged, on the prefill worker.
KV_WRITE = ("pdserve_request_phase_seconds", {"phase": "kv_write"})
# All of a remote prefill's time on neither worker's compute: the hop to the prefill
# worker and its wait for the step it was in, the writes, the notification.
KV_HOP = ("pdserve_request_phase_seconds", {"phase": "transfer"})


def scrape(base_url: str, headers: dict[str, str] | None = None) -> str | None:
    """The router's /metrics text (base_url: the API's, ending in /v1), or None if the
    server has none to give (another server, or a key needed that we lack)."""
    root = base_url.removesuffix("/").removesuffix("/v1")
    try:
        response = httpx.get(f"{root}/metrics", headers=headers or {}, timeout=30.0)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


def transfer_delta(before: str | None, after: str | None,
                   phase: tuple[str, dict[str, str]] = KV_WRITE) -> dict[str, float] | None:
    """A remote prefill's phase per request (KV_WRITE: the KV transfer time; KV_HOP) of
    what ran between two scrapes: count, mean, p50, p99 (seconds); None if either
    scrape failed."""
    if before is None or after is None:
        return None
    name, labels = phase
    return parse_histogram(after, name, labels).minus(parse_histogram(before, name, labels)).summary()
