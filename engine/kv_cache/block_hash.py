"""Chained prefix-cache block hashes, identical in router, prefill and decode workers.

hash(block i) = xxh3_64(seed, parent_hash || token ids of block i). Chaining makes a
block's hash name its whole prefix, so a hit on block i implies hits on 0..i-1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

# Fixed so every process (router, prefill, decode) computes the same hashes.
HASH_SEED = 0x9D5E_12C7
NONE_HASH = 0  # parent hash of the first block


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    payload = parent_hash.to_bytes(8, "little") + np.asarray(token_ids, dtype=np.int64).tobytes()
    return xxhash.xxh3_64_intdigest(payload, seed=HASH_SEED)


def hash_full_blocks(token_ids: Sequence[int], block_size: int,
                     prefix_hashes: Sequence[int] = (), root: int = NONE_HASH) -> list[int]:
    """Hashes of every full block of `token_ids`, continuing after `prefix_hashes`.

    Pass the hashes already known for the first len(prefix_hashes) blocks to extend a
    chain incrementally (a request's hashes grow as it generates tokens). `root`: the
    first block's parent (a LoRA adapter's own, so its blocks are its alone).
    """
    hashes = list(prefix_hashes)
    parent = hashes[-1] if hashes else root
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
