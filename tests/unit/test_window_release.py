"""A sliding-window model's KV blocks follow its window: the manager releases blocks
wholly before a request's window as it advances, keeps them in the prefix cache, and
no reader of its blocks (a fork, a hold, the fence check) trips over the gap."""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import DoesNotFit
from engine.kv_cache.events import DEVICE, KVEvents
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.window import layer_first_blocks, layers_reading
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


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


def test_prefix_hits_before_the_window_keep_only_their_places() -> None:
    """A hit block wholly before the window of the request's first new token is never
    read: it is not taken (nor revived from the free queue), only its place kept."""
    kv = KVCacheManager(num_blocks=12, block_size=4, sliding_window=6)
    first = Request("a", list(range(25)), SamplingParams(max_tokens=1))
    advance(kv, first, 25)
    kv.free(first)  # its 6 full blocks stay cached, free
    second = Request("b", list(range(25)) + [99], SamplingParams(max_tokens=1))
    hits = kv.get_computed_blocks(second)
    assert len(hits) == 6  # tokens 0-23; the first new token, 24, sees 19..24
    assert kv.num_blocks_needed(second, 2, hits) == 2 + 1  # revives blocks 4 and 5, takes 1 new
    assert kv.allocate_slots(second, 2, hits)
    assert kv.block_ids("b")[:4] == [-1] * 4 and kv.num_released("b") == 4
    assert [b.ref_cnt for b in hits] == [0, 0, 0, 0, 1, 1]
    kv.free(second)
    assert kv.num_free_blocks == 12


def test_what_a_request_needs_of_the_pool_with_a_window() -> None:
    """With a window of 20 and blocks of 16 a request runs chunk by chunk in the
    window's span and 5 more blocks (7): a prompt longer than the pool too, but not on
    a prefill worker, which holds its whole prompt for its push."""
    sched = Scheduler(KVCacheManager(8, 16, sliding_window=20), 512, 8, max_model_len=4096)
    sched.check_fits(200, 800)  # 63 blocks' worth of tokens in 8
    with pytest.raises(DoesNotFit, match="prompt \\(200 tokens\\) needs more than the KV pool's 8 blocks"):
        sched.check_fits(200, 1, whole_prompt=True)
    small = Scheduler(KVCacheManager(6, 16, sliding_window=20), 512, 8, max_model_len=4096)
    with pytest.raises(DoesNotFit, match="cannot hold the sliding window of 20 tokens and a step's chunk beside it "
                                         "\\(7 blocks\\)"):
        small.check_fits(200, 10)
    with pytest.raises(DoesNotFit, match="request needs 7 KV blocks \\(prompt 10 \\+ max_tokens 100\\)"):
        small.check_fits(10, 100)
    small.check_fits(10, 70)  # 5 blocks in all: fits without chunks
    assert KVCacheManager(8, 16, sliding_window=20).chunk_limit() == 30  # ((8 - 3) * 16 - 20) // 2


def test_blocks_released_unwritten_are_reported_not_held() -> None:
    """A remote prefill's blocks before the window are released as they are reserved,
    never written: the router, which counts a prompt's blocks as the worker's once it
    sends it there, is told they are not (or it would keep the next such prompt local
    and have it recomputed whole)."""
    kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=6)
    kv.pool.events = KVEvents(1000)
    other = Request("o", list(range(4)) + [7], SamplingParams(max_tokens=1))
    advance(kv, other, 5)  # block 0's tokens cached by another request: that one stays held
    r = Request("r", list(range(24)), SamplingParams(max_tokens=1))
    kv.allocate_slots(r, 24)
    kv.pool.events.take()
    assert kv.release_before(r, kv.window_first_block(23)) == 4
    events, _ = kv.pool.events.take()
    assert events == [(h, DEVICE, False) for h in r.block_hashes[1:4]]


def test_a_mixed_models_blocks_are_split_by_the_layers_that_read_them() -> None:
    """Layers 0 and 2 slide (a window of 20), 1 and 3 read every block: from position
    79 on, the sliding ones read blocks 15 on (blocks of 4), so blocks before carry the
    full layers alone, each a run of its own."""
    first = layer_first_blocks((20, 0, 20, 0), 79, 4)
    assert first == (15, 0, 15, 0)
    assert layers_reading(first, 0, 20, (0, 4)) == [(0, 15, (1, 2)), (0, 15, (3, 4)), (15, 20, (0, 4))]
    # A layer-wise stream's group of layers 1-2, blocks 10-19.
    assert layers_reading(first, 10, 20, (1, 3)) == [(10, 15, (1, 2)), (15, 20, (1, 3))]
    assert layers_reading(first, 0, 15, (0, 1)) == []  # a sliding layer writes nothing before its window
    assert layers_reading((), 3, 5, (0, 4)) == [(3, 5, (0, 4))]  # no windows: every layer, every block
    assert layer_first_blocks((), 79, 4) == ()


def test_a_mixed_models_remote_blocks_before_the_window_are_never_cached() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, layer_windows=(6, 0))
    request = Request("r", list(range(2, 30)), SamplingParams(max_tokens=2))  # 28 tokens: 7 blocks
    assert kv.allocate_slots(request, request.num_tokens)
    # From position 27 the sliding layer reads blocks 5 on; blocks 0-4 come for layer 1 only.
    assert kv.write_by_layer(request, first=0) == (5, 0)
    request.num_computed_tokens = 27
    kv.cache_computed_blocks(request, copied_in=True)
    cached = [b.block_hash is not None for b in kv.req_blocks["r"]]
    assert cached == [False] * 5 + [True, False]  # the last is not full
    kv.free(request)  # a recompute (preempted) writes every layer: cached then
    request.num_computed_tokens = 0
    assert kv.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = 27
    kv.cache_computed_blocks(request)
    assert [b.block_hash is not None for b in kv.req_blocks["r"]][:5] == [True] * 5
    assert kv.write_by_layer(Request("s", list(range(2, 10)), SamplingParams(max_tokens=2)), first=0) == ()
