"""The scheduler always makes progress and never resumes a request from KV it cannot
trust (issue 23): fake model outputs, a real KV cache manager, no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.errors import EngineStateError
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from tests.unit.test_scheduler import run_to_completion, step


def make(num_blocks: int, block_size: int = 4, budget: int = 32, chunked: bool = True) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size), budget, 8, max_model_len=512,
                     enable_chunked_prefill=chunked)


def request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_local_fallback_after_a_prefix_hit_recomputes_in_new_blocks() -> None:
    """Finding 1, under the fence (issue 34): two remote requests with one prompt reserve
    blocks while the cache is cold; A's KV arrives and is cached; B's remote prefill
    fails. B lets go of its reserved blocks (the decode worker holds them, fenced: a
    late write may still land there) and is admitted again like a preempted request:
    its prefix comes from A's cached, known-good KV, the rest is computed in new
    blocks, never in the fenced ones."""
    sched = make(32)
    prompt = list(range(1, 20))
    a, b = request("a", prompt), request("b", prompt)
    assert sched.remote.reserve(a) and sched.remote.reserve(b)
    b_blocks = sched.kv.block_ids("b")
    fenced = sched.kv.hold("b", 0, len(b_blocks))
    sched.remote.arrived(a)
    sched.remote.failed(b)
    out = sched.schedule()
    work = {s.request.request_id: (s.start, s.num_new_tokens) for s in out.scheduled}
    assert work == {"a": (18, 1), "b": (16, 3)}
    assert not set(sched.kv.block_ids("b")) & set(b_blocks)
    sched.update(out, [7] * out.num_samples)
    run_to_completion(sched)
    assert a.output_token_ids == b.output_token_ids == [7] * 4
    sched.kv.free_blocks(fenced)
    assert sched.kv.num_free_blocks == 32


def test_a_request_holding_blocks_never_takes_prefix_hits() -> None:
    sched = make(32)
    a, b = request("a", range(1, 20)), request("b", range(1, 20))
    sched.remote.reserve(a)
    sched.remote.arrived(a)  # a's full blocks are cached now
    sched.remote.reserve(b)  # takes them as hits
    hits = sched.kv.get_computed_blocks(b)
    assert hits
    with pytest.raises(EngineStateError, match="prefix hits only apply"):
        sched.kv.allocate_slots(b, 3, hits)


def test_block_ownership_checks_stay_on_under_python_O() -> None:
    code = ("from engine.kv_cache.block_pool import BlockPool\n"
            "from engine.errors import EngineStateError\n"
            "p = BlockPool(2); b = p.allocate(1); p.free(b)\n"
            "try:\n    p.free(b)\nexcept EngineStateError as e:\n    print('raised', e)\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "raised double free of block 0", out.stderr


def test_a_ready_request_runs_ahead_of_a_head_that_cannot_fit() -> None:
    """Finding 2: a local request preempts itself while a remote reservation holds
    blocks; once that KV arrives, the ready request must run (it needs no new block),
    else neither ever runs again."""
    sched = make(8, budget=64)
    r0 = request("r0", range(1, 15), max_tokens=17)  # 31 tokens: all 8 blocks alone
    sched.add_request(r0)
    step(sched)  # r0 holds 4 blocks
    r1 = request("r1", range(30, 41), max_tokens=3)
    assert sched.remote.reserve(r1)  # 3 blocks; 1 left
    while not sched.num_preemptions:
        step(sched)
    assert r0.status == RequestStatus.PREEMPTED and not sched.running
    sched.remote.arrived(r1)
    outs = run_to_completion(sched, max_steps=200)
    assert outs[0].scheduled[0].request is r1
    assert len(r0.output_token_ids) == 17 and len(r1.output_token_ids) == 3


def test_a_reservation_never_takes_the_blocks_the_queue_head_needs() -> None:
    sched = make(8, budget=64)
    sched.add_request(Request("w1", list(range(1, 22)), SamplingParams(max_tokens=3, ignore_eos=True)))
    step(sched)  # w1 holds 6 blocks: 2 free
    sched.add_request(Request("head", list(range(50, 59)), SamplingParams(max_tokens=2, ignore_eos=True)))
    assert [s.request.request_id for s in step(sched).scheduled] == ["w1"]  # head needs 3: waits
    # A reservation of 2 blocks fits the pool but would starve the head: refused (the
    # caller prefills it locally, queued behind the head), and nothing changes.
    assert not sched.remote.reserve(request("remote", range(60, 66), max_tokens=1))
    assert "remote" not in sched.requests and sched.kv.num_free_blocks == 2
    sched.finish_requests(["w1"], RequestStatus.FINISHED_ABORTED)
    assert sched.remote.reserve(request("remote", range(60, 66), max_tokens=1))


def test_a_preempted_recompute_longer_than_a_step_is_chunked_with_chunking_off() -> None:
    """Finding 4: chunked prefill off, a preempted request's prompt + outputs exceed
    max_num_batched_tokens: it must be chunked or it never comes back."""
    sched = make(2, block_size=8, budget=8, chunked=False)
    a = Request("a", [5, 6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True))
    b = Request("b", [9, 10, 11, 12], SamplingParams(max_tokens=8, ignore_eos=True))
    sched.add_request(a)
    sched.add_request(b)
    run_to_completion(sched, max_steps=100)
    assert sched.num_preemptions >= 1
    assert len(a.output_token_ids) == len(b.output_token_ids) == 8


def test_a_prompt_still_waits_whole_with_chunking_off() -> None:
    sched = make(64, budget=10, chunked=False)
    sched.add_request(Request("a", list(range(1, 7)), SamplingParams(max_tokens=2, ignore_eos=True)))
    sched.add_request(Request("b", list(range(1, 9)), SamplingParams(max_tokens=2, ignore_eos=True)))
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 6)]


def test_no_progress_with_every_block_free_raises() -> None:
    """The net under the progress invariant: a schedule that admits nothing while
    nothing runs and every block is free is a bug, raised, never an endless loop."""
    sched = make(8)
    sched.add_request(request("a", range(1, 6)))
    sched._chunk = lambda request, num_new, budget: None  # break admission
    with pytest.raises(EngineStateError, match="no progress: request 'a'"):
        sched.schedule()


def test_invalidated_blocks_leave_the_prefix_cache_and_name_their_holders() -> None:
    sched = make(16)
    a = request("a", range(1, 14))
    sched.add_request(a)
    step(sched)
    held = sched.kv.block_ids("a")
    assert sched.kv.get_computed_blocks(request("probe", range(1, 14)))  # a's full blocks are cached
    assert sched.kv.invalidate([held[1], 15]) == ["a"]
    hits = sched.kv.get_computed_blocks(request("probe", range(1, 14)))
    assert [b.block_id for b in hits] == held[:1]  # the chain stops at the invalidated block


def test_a_ready_request_waiting_for_room_is_not_overtaken_with_chunking_off() -> None:
    """A local fallback with chunked prefill off needs its whole prompt in one step; the
    waiting queue must not keep overtaking it (each admission keeps the step short of
    room, so it starved for good while holding its blocks)."""
    budget = 32
    sched = Scheduler(KVCacheManager(256, 4), budget, 8, max_model_len=512, enable_chunked_prefill=False)
    sched.add_request(request("long", range(1000, 1008), max_tokens=40))
    step(sched)
    fallback = request("fallback", range(2000, 2000 + budget))  # fits a step only alone
    assert sched.remote.reserve(fallback)
    sched.remote.failed(fallback)
    for i in range(100):
        if i % 3 == 0:  # a steady trickle of short requests
            sched.add_request(request(f"c{i}", range(10000 * (i + 1), 10000 * (i + 1) + 4), max_tokens=6))
        if any(s.request is fallback for s in step(sched).scheduled):
            return
    raise AssertionError("the ready request starved while later requests ran")


def test_probing_the_waiting_head_is_no_prefix_cache_query() -> None:
    """Issue 35, item 9: a remote reservation asks how many blocks the head of the
    waiting queue needs (Scheduler.head_needs); that probe looks the head's prefix up, but the
    cache statistics count a request's query once, when it is admitted (as vLLM's)."""
    sched = make(32)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks of 4, all cacheable
    sched.add_request(request("a", prompt))
    run_to_completion(sched)
    pool = sched.kv.pool
    assert (pool.num_cache_queries, pool.num_cache_hits) == (1, 0)  # a's own admission: a miss
    sched.add_request(request("head", prompt))  # queued, never scheduled yet: its hits wait
    for i in range(3):  # each reservation probes the head; a disjoint prompt: one miss each
        assert sched.remote.reserve(request(f"r{i}", range(100, 113)))
    assert (pool.num_cache_queries, pool.num_cache_hits) == (4, 0)
    out = sched.schedule()  # the head is admitted with its 3 hits: counted now, once
    assert [s.request.request_id for s in out.scheduled] == ["head"] and out.scheduled[0].start == 12
    assert (pool.num_cache_queries, pool.num_cache_hits) == (7, 3)
