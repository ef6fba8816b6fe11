"""Routing policies: prefix affinity with load, and what counts as cached."""

from __future__ import annotations

import pytest

from router.routing import LOAD_TOKENS, PrefixIndex, RoutingPolicy

SHARED = list(range(1000, 1064))  # 4 blocks of 16


AB = ("a", "b")


def idle(*names: str) -> dict[str, int]:
    return dict.fromkeys(names, 0)


def test_kv_aware_sends_a_shared_prefix_back_to_its_worker() -> None:
    policy = RoutingPolicy("kv_aware", 16, capacity_blocks=100, names=AB)
    first, cached = policy.choose(SHARED + [1, 2, 3], loads=idle(*AB))
    assert cached == 0
    other = "b" if first == "a" else "a"
    # Same prefix, the other worker idle: the cache still wins (64 tokens > 1 request).
    again, cached = policy.choose(SHARED + [7, 8], loads={first: 1, other: 0})
    assert again == first and cached == 64
    # An unrelated prompt goes to the less loaded worker.
    assert policy.choose(list(range(5000, 5040)), loads={first: 1, other: 0}) == (other, 0)


def test_load_outweighs_a_small_cached_prefix() -> None:
    policy = RoutingPolicy("kv_aware", 16, capacity_blocks=100, names=AB)
    worker, _ = policy.choose(SHARED[:17], loads=idle(*AB))  # 1 full block recorded
    busy = idle(*AB)
    busy[worker] = 2  # 2 * LOAD_TOKENS > 16 cached tokens
    assert LOAD_TOKENS * 2 > 16
    assert policy.choose(SHARED[:17], loads=busy)[0] != worker


def test_cached_blocks_stop_at_the_first_miss_and_respect_capacity() -> None:
    index = PrefixIndex(capacity=2)
    index.add([1, 2, 3])  # oldest (1) evicted
    assert index.cached_blocks([2, 3, 9]) == 2 and index.cached_blocks([1, 2]) == 0


def test_round_robin_and_least_loaded() -> None:
    rr = RoutingPolicy("round_robin", 16, 10, names="xyz")
    assert [rr.choose([1, 2], idle(*"xyz"))[0] for _ in range(4)] == ["x", "y", "z", "x"]
    ll = RoutingPolicy("least_loaded", 16, 10, names="xyz")
    assert ll.choose([1, 2], {"x": 3, "y": 1, "z": 2}) == ("y", 0)


def test_ties_go_to_the_worker_that_joined_first() -> None:
    """Whatever order the caller lists the loads in: the pool's order decides."""
    for policy in ("least_loaded", "kv_aware"):
        routing = RoutingPolicy(policy, 16, 10, names=["d1", "d0"])
        assert routing.choose([1, 2], {"d0": 0, "d1": 0})[0] == "d1"


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "kv_aware"])
def test_only_the_workers_offered_are_ever_chosen(policy: str) -> None:
    """`loads` lists the workers that may take the request (live, not draining)."""
    routing = RoutingPolicy(policy, 16, 10, names="xyz")
    assert {routing.choose(list(range(40)), {"y": 5})[0] for _ in range(4)} == {"y"}
    with pytest.raises(ValueError, match="no live worker"):
        routing.choose([1, 2], {})


def test_round_robin_goes_on_round_the_pool_as_workers_join_and_leave() -> None:
    rr = RoutingPolicy("round_robin", 16, 10, names="xy")
    assert rr.choose([1], idle("x", "y"))[0] == "x"
    rr.add("z")  # as before: a change to the pool starts the round again
    assert [rr.choose([1], idle(*"xyz"))[0] for _ in range(3)] == ["x", "y", "z"]
    rr.remove("y")
    assert [rr.choose([1], idle("x", "z"))[0] for _ in range(3)] == ["x", "z", "x"]


def test_a_workers_eviction_events_correct_the_routing_history() -> None:
    from engine.kv_cache.block_hash import hash_full_blocks

    policy = RoutingPolicy("kv_aware", 16, capacity_blocks=100, names=AB)
    first, _ = policy.choose(SHARED + [1], loads=idle(*AB))
    other = "b" if first == "a" else "a"
    assert policy.choose(SHARED + [2], loads=idle(*AB)) == (first, 64)
    hashes = hash_full_blocks(SHARED, 16)
    policy.kv_events(first, [[hashes[2], 0, False]], reset=False)  # its third block was evicted
    assert policy.choose(SHARED + [3], loads=idle(*AB)) == (first, 32)  # chained: only 2 blocks left
    policy.kv_events(first, [], reset=True)  # events were lost: nothing is assumed cached
    assert policy.indexes[first].cached_blocks(hashes) == 0
    policy.kv_events(other, [[h, 0, True] for h in hashes], reset=False)  # the other cached them
    assert policy.choose(SHARED + [4], loads=idle(*AB)) == (other, 64)
    policy.kv_events("gone", [[hashes[0], 0, True]], reset=False)  # a worker that left meanwhile: ignored
    assert "gone" not in policy.indexes


def test_kv_aware_scores_a_hit_by_its_tier() -> None:
    """device > host > disk > shared > none (Dynamo's and llm-d's order), and a block a
    worker holds in any tier counts as cached for the remote-prefill decision."""
    from engine.kv_cache.block_hash import hash_full_blocks
    from engine.kv_cache.events import DEVICE, DISK, HOST
    from engine.kv_cache.events import SHARED as STORE

    names = ("dev", "host", "disk", "store", "none")
    policy = RoutingPolicy("kv_aware", 16, capacity_blocks=100, names=names)
    hashes = hash_full_blocks(SHARED, 16)
    policy.kv_events("dev", [[h, DEVICE, True] for h in hashes], reset=False)
    # Evicted from the device, sealed in the host tier: two events.
    policy.kv_events("host", [e for h in hashes for e in ([h, DEVICE, True], [h, DEVICE, False], [h, HOST, True])],
                     reset=False)
    policy.kv_events("disk", [[h, DISK, True] for h in hashes], reset=False)
    policy.kv_events("store", [[h, STORE, True] for h in hashes], reset=False)
    assert policy.indexes["host"].cached_tiers(hashes) == [HOST] * 4
    order = []
    for _ in names:
        name, cached = policy.choose(SHARED + [5], loads={n: 0 for n in names if n not in order})
        order.append(name)
        assert cached == (0 if name == "none" else 64)
    assert order == list(names)
    # A block in both offload tiers is the nearer's; leaving one tier keeps the other.
    index = PrefixIndex(100)
    index.apply([[h, DISK, True] for h in hashes] + [[hashes[0], HOST, True]])
    assert index.cached_tiers(hashes) == [HOST, DISK, DISK, DISK]
    index.apply([[hashes[0], HOST, False]])
    assert index.cached_tiers(hashes)[:1] == [DISK]
    index.apply([[hashes[1], DISK, False]])  # chained: a hole ends the hit
    assert index.cached_blocks(hashes) == 1
    # Load still counts: a busy device hit loses to an idle host hit.
    busy = RoutingPolicy("kv_aware", 16, capacity_blocks=100, names=("dev", "host"))
    busy.kv_events("dev", [[h, DEVICE, True] for h in hashes], reset=False)
    busy.kv_events("host", [[h, HOST, True] for h in hashes], reset=False)
    assert busy.choose(SHARED + [6], loads={"dev": 3, "host": 0})[0] == "host"
    assert busy.choose(SHARED + [7], loads={"dev": 0, "host": 0})[0] == "dev"
