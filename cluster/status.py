"""`pdserve status`: a running deployment's decode workers, as its router sees them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

COLUMNS = ("worker", "live", "running", "waiting", "waiting_kv", "kv_used", "remote", "local", "fallbacks")


def fetch_status(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """GET {url}/status (url: the router's base, e.g. http://127.0.0.1:8000)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/status", timeout=timeout) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError) as exc:
        raise ConnectionError(f"no pdserve router answers at {url}: {exc}") from None


def format_status(status: dict[str, Any]) -> str:
    """A table a row per decode worker; KV used = blocks not free / all blocks."""
    rows = []
    for w in status["decode_workers"]:
        s = w["stats"] or {}
        used = f"{1 - s['free_blocks'] / s['num_blocks']:.0%}" if s.get("num_blocks") else "?"
        rows.append((w["name"], "yes" if w["live"] else "NO", *(str(s.get(k, "?")) for k in
                     ("running", "waiting", "waiting_for_kv")), used,
                     *(str(s.get(k, "?")) for k in ("remote", "local", "fallbacks"))))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    lines = [f"model {status['model']}; prefill pool: {'yes' if status['prefill_pool'] else 'no'}; "
             f"requests in flight: {status['in_flight']}",
             "  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
