"""Prefix-cache events: which blocks a worker's KV cache holds, tier by tier, in order,
for the router's kv_aware index (router/routing.py). Kept only while someone collects
them (a decode worker: EngineCore.collect_kv_events).

An event is (block hash, tier, stored): stored True when the tier starts to hold the
block (the device pool: once its KV is written; an offload tier: once it is sealed, so
findable), False when it stops (reused, evicted, or refused as corrupt). A block moved
from the device pool to the host tier is two events: device False, then host True.
The shared tier's events are the changes to the worker's copy of the store's directory
(kv_store/client.py), which every worker of the deployment reports alike.
"""

from __future__ import annotations

from collections.abc import Callable

DEVICE, HOST, DISK, SHARED = 0, 1, 2, 3  # tiers, nearest first (the order a lookup tries them)
TIER_NAMES = ("device", "host", "disk", "shared")

Event = tuple[int, int, bool]


class KVEvents:
    """Events not yet taken. More than `limit` of them: nobody is taking them; they are
    dropped and take() says so (the collector starts its index over)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.items: list[Event] = []
        self.lost = False
        # Events kept elsewhere (the shared tier's, by another thread), taken with these.
        self.more: Callable[[], tuple[list[Event], bool]] | None = None

    def record(self, block_hash: int, tier: int, stored: bool) -> None:
        self.items.append((block_hash, tier, stored))
        if len(self.items) > self.limit:
            self.items.clear()
            self.lost = True

    def take(self) -> tuple[list[Event], bool]:
        """The events since the last take, in order, and whether some were dropped since."""
        items, lost = self.items, self.lost
        self.items, self.lost = [], False
        if self.more is not None:
            more, more_lost = self.more()
            items, lost = items + more, lost or more_lost
        return items, lost
