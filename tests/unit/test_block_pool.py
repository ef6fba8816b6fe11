"""Block pool and KV cache manager invariants (pure Python, no model)."""

from __future__ import annotations

import pytest

from engine.errors import EngineStateError
from engine.kv_cache.block_hash import NONE_HASH, hash_block, hash_full_blocks
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.events import DEVICE, KVEvents
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_hashes_are_chained_and_deterministic() -> None:
    a = hash_full_blocks(list(range(40)), 16)
    assert len(a) == 2  # the partial third block has no hash
    assert a == hash_full_blocks(list(range(40)), 16)
    assert a[1] == hash_block(a[0], list(range(16, 32)))
    # Same tokens after a different prefix: a different hash.
    b = hash_full_blocks([99] + list(range(1, 40)), 16)
    assert b[1] != a[1]
    # Extending incrementally equals hashing from scratch.
    assert hash_full_blocks(list(range(64)), 16, a) == hash_full_blocks(list(range(64)), 16)


def test_free_queue_is_lru_and_eviction_drops_hash() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="only 0 free"):
        pool.allocate(1)
    h = hash_block(NONE_HASH, [1, 2])
    pool.cache(blocks[2], NONE_HASH, h, [1, 2])
    pool.free([blocks[2], blocks[0]])  # block 2 freed first: oldest, evicted first
    assert pool.lookup(NONE_HASH, h, [1, 2]) is blocks[2]
    first = pool.allocate(1)[0]
    assert first is blocks[2] and first.block_hash is None
    assert pool.lookup(NONE_HASH, h, [1, 2]) is None


def test_a_requests_blocks_freed_tail_first_come_back_ascending() -> None:
    """A request's blocks are freed tail-first; the next one must still get consecutive
    ids in ascending order, which a KV push moves as one descriptor (kv_transfer/runs.py)."""
    pool = BlockPool(6)
    first = pool.allocate(6)
    pool.free(reversed(first))
    again = pool.allocate(6)
    assert [b.block_id for b in again] == [0, 1, 2, 3, 4, 5]
    pool.free(reversed(again))
    # Which blocks go is still the queue's order: the first three freed (5, 4, 3).
    assert [b.block_id for b in pool.allocate(3)] == [3, 4, 5]


def test_lookup_verifies_tokens_not_just_hash() -> None:
    pool = BlockPool(2)
    block = pool.allocate(1)[0]
    pool.cache(block, NONE_HASH, 1234, [5, 6])
    assert pool.lookup(NONE_HASH, 1234, [5, 6]) is block
    assert pool.lookup(NONE_HASH, 1234, [5, 7]) is None  # a hash collision is not a hit
    assert pool.lookup(77, 1234, [5, 6]) is None  # nor is another parent


def test_touch_revives_free_cached_block_and_refcounts() -> None:
    pool = BlockPool(3)
    block = pool.allocate(1)[0]
    pool.cache(block, NONE_HASH, 42, [1])
    pool.free([block])
    assert pool.num_free_blocks == 3
    pool.touch([block])
    pool.touch([block])
    assert block.ref_cnt == 2 and pool.num_free_blocks == 2
    pool.free([block, block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 3
    with pytest.raises(EngineStateError, match="double free"):
        pool.free([block])


def test_manager_reuses_cached_prefix_and_frees_everything() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.get_computed_blocks(a) == []
    assert kv.allocate_slots(a, 10)
    assert len(kv.block_ids("a")) == 3
    a.num_computed_tokens = 10
    kv.cache_computed_blocks(a)

    b = make_request("b", list(range(8)) + [50, 51, 52])
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == kv.block_ids("a")[:2]
    assert kv.allocate_slots(b, 3, hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]  # shared, not recomputed
    assert kv.pool.blocks[kv.block_ids("a")[0]].ref_cnt == 2

    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 10
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_full_hit_still_recomputes_last_token() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    b = make_request("b", list(range(8)))
    # Both blocks are cached, but only the first may count: the last token needs logits.
    assert len(kv.get_computed_blocks(b)) == 1


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(20)))
    assert not kv.allocate_slots(a, 20)
    assert kv.num_free_blocks == 3 and kv.block_ids("a") == []


def test_disabled_prefix_caching_never_hits() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == []


def test_prefix_cache_events_report_caching_and_eviction_in_order() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, NONE_HASH, 11, [1])
    assert pool.events is None  # nobody collects: nothing is kept
    pool.events = KVEvents(limit=100)
    pool.cache(b, 11, 22, [2])
    pool.cache(b, 11, 22, [2])  # already cached: no event
    pool.free([b, a])
    pool.allocate(2)  # both evicted, least recently freed first
    assert pool.events.take() == ([(22, DEVICE, True), (22, DEVICE, False), (11, DEVICE, False)], False)
    assert pool.events.take() == ([], False)  # each is taken once


def test_uncollected_events_beyond_the_limit_are_dropped_and_that_is_said() -> None:
    """Bounded wherever an event is made (a remote prefill's reservation, its KV
    arriving, an abort), not only in an engine step: a decode worker whose router stops
    asking must not pile them up."""
    pool = BlockPool(4)
    pool.events = KVEvents(limit=3)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks[:3]):
        pool.cache(block, NONE_HASH, 100 + i, [i])
    assert len(pool.events.items) == 3 and not pool.events.lost
    pool.cache(blocks[3], NONE_HASH, 103, [3])
    assert pool.events.take() == ([], True)
    assert pool.events.take() == ([], False)  # said once
