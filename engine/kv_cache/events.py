"""Prefix-cache events: which blocks a worker's KV cache holds, tier by tier, in order,
for the router's kv_aware index (router/routing.py). Kept only while someone collects
them (a decode worker: EngineCore.collect_kv_events).

An event is (block hash, tier, stored): stored True when the tier starts to hold the
block (the device pool: once its KV is written; an offload tier: once it is sealed, so
findable), False when it stops (reused, evicted, or refused as corrupt). A block moved
from the device pool to the host tier is two events: device False, then host True.
"""

from __future__ import annotations

DEVICE, HOST, DISK = 0, 1, 2  # tiers, nearest first (the order a lookup tries them)
TIER_NAMES = ("device", "host", "disk")

Event = tuple[int, int, bool]


class KVEvents:
    """Events not yet taken. More than `limit` of them: nobody is taking them; they are
    dropped and take() says so (the collector starts its index over)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.items: list[Event] = []
        self.lost = False

    def record(self, block_hash: int, tier: int, stored: bool) -> None:
        self.items.append((block_hash, tier, stored))
        if len(self.items) > self.limit:
            self.items.clear()
            self.lost = True

    def take(self) -> tuple[list[Event], bool]:
        """The events since the last take, in order, and whether some were dropped since."""
        items, lost = self.items, self.lost
        self.items, self.lost = [], False
        return items, lost
