"""What the offload tiers need of a KV store shared by a deployment's workers (the
client in kv_store/client.py is one; the engine imports none), and the block record
that crosses between them.

The shared tier sits below the worker's own host and disk tiers: every block sealed in
the host tier is also put to the store, and a prefix lookup that runs past the worker's
own tiers goes on in the store's directory (a copy the client keeps up to date, so a
lookup never waits on the network). Loading such blocks fetches them on the tiers' I/O
thread; a block the store no longer has, or a store that does not answer, fails the
load and the request computes those tokens instead (engine/tier_loads.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SharedBlock:
    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]
    checksum: int  # tier_io.checksum of the bytes, seeded with the namespace
    data: bytes | memoryview  # each rank's piece, one after another (as a disk slot holds them)


class StoreUnavailable(OSError):
    """The store did not answer in time (down, or unreachable)."""


class SharedTier(Protocol):
    def open(self, namespace: int) -> None:
        """Start, for the blocks of this configuration (the engine's checksum seed)."""

    def holds(self, block_hash: int) -> bool:
        """The directory has the block (False while the store is unreachable). The
        engine's thread; never blocks."""

    def forget(self, hashes: Sequence[int]) -> None:
        """A fetch did not bring these: stop finding them until the store says again."""

    def put(self, block: SharedBlock) -> None:
        """Send the block (the I/O thread); never blocks: dropped when it cannot go."""

    def revoke(self, hashes: Sequence[int]) -> None:
        """These blocks' bytes were bad when copied (the engine's thread; never blocks):
        from now on holds() is False and put() skips them, whatever the store says, and
        the store is told to drop them by the next send_drops()."""

    def send_drops(self) -> None:
        """Tell the store to drop what revoke() named (the I/O thread, after any put of
        those blocks; never blocks: what cannot go now goes with the next call)."""

    def fetch(self, hashes: Sequence[int]) -> list[SharedBlock]:
        """The chain's first blocks the store holds, in order (the I/O thread);
        StoreUnavailable when it does not answer within the client's timeout."""

    def blocks(self) -> int:
        """Blocks in the directory now."""

    def usage(self) -> tuple[int, int]:
        """(capacity, used) bytes of the whole store, as its latest directory said (0, 0
        before one came)."""

    def track_changes(self) -> None:
        """Keep the directory's changes from now on, for take_changes."""

    def take_changes(self) -> tuple[list[tuple[int, bool]], bool]:
        """(block hash, held?) for each change to the directory since the last take, in
        order, and whether some were dropped since (too many untaken: start over)."""

    def close(self) -> None: ...
