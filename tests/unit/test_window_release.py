"""A sliding-window model's KV blocks follow its window: the manager releases blocks
wholly before a request's window as it advances, keeps them in the prefix cache, and
no reader of its blocks (a fork, a hold, the fence check) trips over the gap."""

from __future__ import annotations

import numpy as np
import pytest

from engine.kv_cache.manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def advance(kv: KVCacheManager, request: Request, num_new: int) -> None:
    """One step computing num_new more tokens, as the scheduler and its update do it."""
    assert kv.allocate_slots(request, num_new)
    request.num_computed_tokens += num_new
    kv.cache_computed_blocks(request)
    kv.release_out_of_window(request)


def test_blocks_before_the_window_are_released_and_stay_cached() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=6)
    r = Request("a", list(range(20)), SamplingParams(max_tokens=40))
    advance(kv, r, 10)  # next token at 10 sees 5..10: block 0 (tokens 0-3) is out
    assert kv.block_ids("a")[0] == -1 and kv.num_held_blocks("a") == 2
    held_over_time = []
    for _ in range(30):
        if r.num_computed_tokens == r.num_tokens:  # decoding: the sampled token joins the sequence
            r.append_output_token(7)
        advance(kv, r, 1)
        held_over_time.append(kv.num_held_blocks("a"))
    # Never more than the window's blocks (6 tokens span at most 3 blocks of 4), plus the
    # one the next token goes into.
    assert max(held_over_time) <= 3 and len(kv.block_ids("a")) == 10
    table = kv.block_tables(["a"])[0]
    released = [i for i, b in enumerate(kv.block_ids("a")) if b == -1]
    assert released == list(range(len(released))) and np.all(table[released] == 0)
    # The released full blocks are free and still cached: a request with the same prefix hits them.
    assert kv.num_free_blocks == 16 - kv.num_held_blocks("a")
    b = Request("b", list(range(20)) + [1], SamplingParams(max_tokens=1))
    assert len(kv.get_computed_blocks(b)) == 5
    kv.free(r)
    assert kv.num_free_blocks == 16 and all(block.ref_cnt == 0 for block in kv.pool.blocks)


def test_no_window_releases_nothing() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    r = Request("a", list(range(30)), SamplingParams(max_tokens=1))
    advance(kv, r, 30)
    assert -1 not in kv.block_ids("a") and kv.num_held_blocks("a") == 8


def test_fork_hold_and_fences_respect_released_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=4)
    parent = Request("p", list(range(18)), SamplingParams(max_tokens=4))
    advance(kv, parent, 18)  # next token at 18 sees 15..18: blocks 0-2 out
    assert kv.block_ids("p")[:3] == [-1, -1, -1]
    child = Request("c", list(range(18)), SamplingParams(max_tokens=4))
    kv.fork(parent, child)
    assert kv.block_ids("c") == kv.block_ids("p") and kv.num_held_blocks("c") == 2
    with pytest.raises(ValueError, match="released its first 3 blocks"):
        kv.hold("p", 0, 4)
    assert len(kv.hold("p", 3, 5)) == 2
    # Block 0 fenced for someone else's remote write: the 0s standing for released
    # blocks in these requests' tables are not reads of it.
    kv.fence([0])
    kv.block_tables(["p", "c"])
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 14  # the two held blocks stay out until released


def test_negative_window_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window must be >= 0"):
        KVCacheManager(num_blocks=4, block_size=4, sliding_window=-1)
