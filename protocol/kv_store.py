"""The shared KV store's messages (kv_store/): typed, versioned and checked as every
message is (protocol/wire.py). Block bytes never go inside a message: each block a
message names travels in a ZMQ frame after it, in the order named.

    worker -> store   StorePut (+1 frame)         a block the worker offloaded; no answer
    worker -> store   StoreFetch                  a chain of blocks, in prefix order
    store -> worker   StoreBlocks (+1 frame each) the chain's first blocks the store holds
    worker -> store   StoreDrop                   blocks whose bytes the worker learned are bad; no answer
    worker -> store   StoreSync                   what changed since `since`
    store -> worker   StoreDirectory              the block hashes added and removed

A block is named by the engine's prefix-cache hash chain within a `namespace`: the seed
of the engine's checksums (engine/kv_cache/tiers.py), which names the model, dtype,
layout and ranks. A worker checks every fetched block's parent, tokens and checksum
before it uses the bytes, so a block of another configuration is never reused.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from protocol.stats import Record
from protocol.wire import Codec, Message

U64 = Annotated[int, msgspec.Meta(ge=0)]  # 64-bit hashes (msgpack carries uint64)
Seq = Annotated[int, msgspec.Meta(ge=0)]
MAX_BLOCK_TOKENS = 1024  # a block's tokens at most (EngineConfig.block_size is far smaller)
MAX_CHAIN = 1 << 14  # blocks one fetch names at most (workers ask in batches of 32 MiB)


class StoredBlock(Record, frozen=True):
    """One block as the store keeps it (its bytes follow in a frame)."""

    block_hash: U64
    parent_hash: U64
    token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCK_TOKENS)]
    checksum: U64  # xxh3 of the bytes, seeded with the namespace (engine/kv_cache/tier_io.py)


class StorePut(Message, frozen=True, tag="store_put"):
    namespace: U64
    block: StoredBlock


class StoreDrop(Message, frozen=True, tag="store_drop"):
    """Forget these blocks: the worker that put them found, after the put, that their
    KV was not what their hash says (a late remote write landed in them)."""

    namespace: U64
    hashes: Annotated[list[U64], msgspec.Meta(max_length=MAX_CHAIN)]


class StoreFetch(Message, frozen=True, tag="store_fetch"):
    seq: Seq  # echoed: an answer to a fetch given up on is told apart and dropped
    namespace: U64
    hashes: Annotated[list[U64], msgspec.Meta(max_length=MAX_CHAIN)]  # a chain, in prefix order


class StoreBlocks(Message, frozen=True, tag="store_blocks"):
    seq: Seq
    blocks: list[StoredBlock]  # the fetched chain's first len(blocks) blocks


class StoreSync(Message, frozen=True, tag="store_sync"):
    seq: Seq
    namespace: U64
    since: Seq  # the directory version the worker has applied (0: none)


class StoreDirectory(Message, frozen=True, tag="store_directory"):
    seq: Seq
    store: U64  # drawn at the store's start: a store restarted at the same address differs
    version: Seq  # the store's directory version now
    reset: bool  # `added` is every block held: the store's log no longer reaches `since`
    # added: a block stored, or put again (a worker that forgot it after a failed fetch
    # finds it again); removed: evicted
    added: list[U64]
    removed: list[U64]
    capacity_bytes: U64  # the store's, every namespace together: the shared tier's usage in stats
    used_bytes: U64


KV_STORE_MESSAGES = Codec(StorePut, StoreDrop, StoreFetch, StoreBlocks, StoreSync, StoreDirectory)
