"""`pdserve status`: a running deployment's workers, as its router sees them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

# (column, stats key) per pool; "kv_used" is computed: blocks not free / all blocks.
DECODE_COLUMNS = (("running", "running"), ("waiting", "waiting"), ("waiting_kv", "waiting_for_kv"),
                  ("kv_used", None), ("remote", "remote"), ("local", "local"), ("fallbacks", "fallbacks"))
PREFILL_COLUMNS = (("jobs", "jobs"), ("kv_used", None), ("prefills", "prefills"),
                   ("blocks_sent", "blocks_written"), ("failed", "failed"))


def fetch_status(url: str, timeout: float = 10.0, api_key: str | None = None) -> dict[str, Any]:
    """GET {url}/status (url: the router's base, e.g. http://127.0.0.1:8000), with
    `Authorization: Bearer api_key` when given. PermissionError if the router refuses
    the key (or asks for one)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url.rstrip('/')}/status", headers=headers),
                                    timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            what = "refused the API key" if api_key else "needs an API key"
            raise PermissionError(f"the router at {url} {what} (401): set PDSERVE_API_KEY or pass --api-key") from None
        raise ConnectionError(f"the router at {url} answered {exc.code} to /status") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ConnectionError(f"no pdserve router answers at {url}: {exc}") from None


def _ranks(stats: dict[str, Any]) -> str:
    """A tensor-parallel group is one worker: its size, then its ranks' process ids
    (rank 0 first), e.g. 2:4711,4712."""
    ranks = stats.get("ranks") or []
    return f"{len(ranks)}:{','.join(map(str, ranks))}" if ranks else "?"


def _table(title: str, workers: list[dict[str, Any]], columns: tuple[tuple[str, str | None], ...]) -> list[str]:
    header = ("worker", "live", "address", "tp", *(c for c, _ in columns))
    rows = []
    for w in workers:
        s = w["stats"] or {}
        cells = []
        for _, key in columns:
            if key is None:
                cells.append(f"{1 - s['free_blocks'] / s['num_blocks']:.0%}" if s.get("num_blocks") else "?")
            else:
                cells.append(str(s.get(key, "?")))
        rows.append((w["name"], "yes" if w["live"] else "NO", w.get("address", "?"), _ranks(s), *cells))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(header)]
    return [title, "  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip()] + [
        "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_status(status: dict[str, Any]) -> str:
    """A table per pool, a row per worker."""
    lines = [f"model {status['model']}; requests in flight: {status['in_flight']}", ""]
    lines += _table("decode pool", status["decode_workers"], DECODE_COLUMNS)
    prefill = status.get("prefill_workers", [])
    lines += [""] + (_table("prefill pool", prefill, PREFILL_COLUMNS) if prefill else ["prefill pool: none"])
    return "\n".join(lines)
