"""`pdserve scale` over HTTP: the router's admin endpoints (router/admin.py), with an
admin key."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

# Scaling waits for new workers to load and old ones to drain.
SCALE_TIMEOUT_S = 900.0


def admin_request(url: str, method: str, path: str, key: str | None, body: dict[str, Any] | None = None,
                  timeout: float = SCALE_TIMEOUT_S) -> dict[str, Any]:
    """{url}{path} with `Authorization: Bearer key`; its JSON answer. PermissionError for
    401/403, ValueError with the router's message for 400, ConnectionError otherwise."""
    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{base}{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        message = _message(exc)
        if exc.code in (401, 403):
            hint = "" if key else " (set PDSERVE_ADMIN_KEY or pass --admin-key)"
            raise PermissionError(f"the router at {base} refused: {message}{hint}") from None
        if exc.code == 400:
            raise ValueError(message) from None
        raise ConnectionError(f"the router at {base} answered {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ConnectionError(f"no pdserve router answers at {base}: {exc}") from None


def _message(exc: urllib.error.HTTPError) -> str:
    try:
        return json.loads(exc.read())["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return exc.reason or str(exc.code)


def describe(result: dict[str, Any]) -> str:
    """A scale result (or the pools' sizes), as a line."""
    line = f"prefill {result['prefill']}, decode {result['decode']}"
    if result.get("added"):
        line += f"; added {', '.join(result['added'])}"
    if result.get("removed"):
        line += f"; removed {', '.join(result['removed'])}"
    if result.get("moved_requests"):
        line += f"; {result['moved_requests']} request(s) moved off drained workers"
    if "seconds" in result:
        line += f" ({result['seconds']:.1f} s)"
    return line
