"""The router's admin endpoints, for operators and `pdserve scale`: the pools' sizes
(GET /admin/pools) and a scale request (POST /admin/scale {"prefill": N, "decode": M}).

They need an admin key (router.admin_keys), never an API key: a client of the model
must not be able to change the deployment. Without admin keys configured they answer
403 (off). The router only parses and answers; what scales is the launcher's
(cluster/elastic.py), handed to the router as a `Scaling`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

from router.errors import APIError

ADMIN_PREFIX = "/admin/"
POOLS = ("prefill", "decode")


class Scaled(Protocol):
    def as_dict(self) -> dict[str, Any]: ...


class Scaling(Protocol):
    """cluster/elastic.py's PoolScaler, as the router sees it."""

    def sizes(self) -> dict[str, int]: ...

    def scale(self, prefill: int | None = None, decode: int | None = None, reason: str = "manual",
              expect: dict[str, int] | None = None) -> Scaled:
        """Blocks until done; ValueError for a target it refuses (its message says why),
        RuntimeError for a worker that did not start."""


def scale_targets(body: bytes) -> dict[str, int]:
    """The pools' targets a scale request names; APIError 400 naming what is wrong."""
    try:
        data = json.loads(body or b"null")
    except RecursionError:  # nesting deeper than the parser's recursion: bad input, not a 500
        raise APIError(400, "the body is not JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
        raise APIError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, 'the body must be a JSON object such as {"prefill": 1, "decode": 2}')
    unknown = sorted(set(data) - set(POOLS))
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r}; a scale request names {POOLS}", unknown[0])
    if not data:
        raise APIError(400, "name at least one pool to scale: prefill, decode")
    for pool, target in data.items():
        if not isinstance(target, int) or isinstance(target, bool) or target < 0:
            raise APIError(400, f"{pool} must be a number of workers (an integer >= 0), got {target!r}", pool)
    return data


def _param_of(message: str, targets: dict[str, int]) -> str | None:
    """The field a refusal names (the scaler's messages start with the pool; one past
    max_workers names both pools, so no single field)."""
    pool = message.partition(":")[0]
    return pool if pool in targets else None


async def scale(scaling: Scaling | None, body: bytes) -> dict[str, Any]:
    """Run a scale request (in a thread: it waits for workers to start and drain)."""
    targets = scale_targets(body)
    if scaling is None:
        raise APIError(503, "this deployment cannot scale (its router runs without a launcher)",
                       kind="service_unavailable")
    try:
        result = await asyncio.to_thread(scaling.scale, targets.get("prefill"), targets.get("decode"), "admin")
    except ValueError as exc:  # out of bounds: nothing was done
        raise APIError(400, str(exc), _param_of(str(exc), targets)) from None
    except RuntimeError as exc:  # a new worker did not start; those before it serve
        raise APIError(500, f"the scale request failed: {exc}", kind="internal_server_error") from None
    return result.as_dict()
