"""Routing policies: prefix affinity with load, and what counts as cached."""

from __future__ import annotations

import pytest

from router.routing import LOAD_TOKENS, PrefixIndex, RoutingPolicy

SHARED = list(range(1000, 1064))  # 4 blocks of 16


def test_kv_aware_sends_a_shared_prefix_back_to_its_worker() -> None:
    policy = RoutingPolicy("kv_aware", 2, 16, capacity_blocks=100)
    first, cached = policy.choose(SHARED + [1, 2, 3], loads=[0, 0])
    assert cached == 0
    # Same prefix, the other worker idle: the cache still wins (64 tokens > 1 request).
    again, cached = policy.choose(SHARED + [7, 8], loads=[1 if first == 0 else 0, 1 if first == 1 else 0])
    assert again == first and cached == 64
    # An unrelated prompt goes to the less loaded worker.
    other, cached = policy.choose(list(range(5000, 5040)), loads=[1 if first == 0 else 0, 1 if first == 1 else 0])
    assert other != first and cached == 0


def test_load_outweighs_a_small_cached_prefix() -> None:
    policy = RoutingPolicy("kv_aware", 2, 16, capacity_blocks=100)
    worker, _ = policy.choose(SHARED[:17], loads=[0, 0])  # 1 full block recorded
    busy = [0, 0]
    busy[worker] = 2  # 2 * LOAD_TOKENS > 16 cached tokens
    assert LOAD_TOKENS * 2 > 16
    assert policy.choose(SHARED[:17], loads=busy)[0] != worker


def test_cached_blocks_stop_at_the_first_miss_and_respect_capacity() -> None:
    index = PrefixIndex(capacity=2)
    index.add([1, 2, 3])  # oldest (1) evicted
    assert index.cached_blocks([2, 3, 9]) == 2 and index.cached_blocks([1, 2]) == 0


def test_round_robin_and_least_loaded() -> None:
    rr = RoutingPolicy("round_robin", 3, 16, 10)
    assert [rr.choose([1, 2], [0, 0, 0])[0] for _ in range(4)] == [0, 1, 2, 0]
    ll = RoutingPolicy("least_loaded", 3, 16, 10)
    assert ll.choose([1, 2], [3, 1, 2]) == (1, 0)


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "kv_aware"])
def test_dead_workers_are_never_chosen(policy: str) -> None:
    routing = RoutingPolicy(policy, 3, 16, 10)
    live = [False, True, False]
    assert {routing.choose(list(range(40)), [0, 5, 0], live)[0] for _ in range(4)} == {1}
    with pytest.raises(ValueError, match="no live worker"):
        routing.choose([1, 2], [0, 0, 0], [False] * 3)


def test_a_workers_eviction_events_correct_the_routing_history() -> None:
    from engine.kv_cache.block_hash import hash_full_blocks

    policy = RoutingPolicy("kv_aware", 2, 16, capacity_blocks=100)
    first, _ = policy.choose(SHARED + [1], loads=[0, 0])
    assert policy.choose(SHARED + [2], loads=[0, 0]) == (first, 64)
    hashes = hash_full_blocks(SHARED, 16)
    policy.kv_events(first, [[hashes[2], False]], reset=False)  # its third block was evicted
    assert policy.choose(SHARED + [3], loads=[0, 0]) == (first, 32)  # chained: only 2 blocks left
    policy.kv_events(first, [], reset=True)  # events were lost: nothing is assumed cached
    assert policy.indexes[first].cached_blocks(hashes) == 0
    policy.kv_events(1 - first, [[h, True] for h in hashes], reset=False)  # the other cached them
    assert policy.choose(SHARED + [4], loads=[0, 0]) == (1 - first, 64)
