"""Parallel sampling (n > 1): the prompt's KV is computed once and shared copy-on-write
by the n sequences (engine/fork_groups.py). Each sequence must give exactly the tokens
of a single request sent with its derived seed (seed + i), in float32, whatever the
pool size, the scheduling mode or where the prompt's KV came from."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.kv_cache.manager import cdiv
from engine.sampling_params import SamplingParams, child_request_id
from tests.disagg.test_remote_prefill import worker_pair
from tests.fidelity.test_hf_fidelity import random_prompts

BS = 16
# 37 tokens: the forked last block is partial (copied on write); 33: the last prompt
# token starts a block of its own (nothing to copy).
PROMPT_PARTIAL, PROMPT_ALIGNED = random_prompts([37, 33], seed=20)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, seed=11, ignore_eos=True)


def engine(model: Path, **options) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model), block_size=BS, **{"num_kv_blocks": 64, **options}))


def drain(core: EngineCore, timeout: float = 60.0) -> dict[str, list[int]]:
    out, end = {}, time.monotonic() + timeout
    while core.has_unfinished():
        assert time.monotonic() < end, "the engine did not finish"
        for r in core.step().finished:
            out[r.request_id] = list(r.output_token_ids)
    return out


def singles(model: Path, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """Each sequence's oracle: a single request with its derived params, alone."""
    core = engine(model)
    for i in range(params.n):
        core.add_request(f"s{i}", prompt, params.child(i))
    done = drain(core)
    return [done[f"s{i}"] for i in range(params.n)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("prompt", [PROMPT_PARTIAL, PROMPT_ALIGNED], ids=["partial", "aligned"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_sequence_equals_a_single_request_with_its_seed(llama_dir: Path, prompt: list[int],
                                                             async_scheduling: bool) -> None:
    params = SamplingParams(**{**SAMPLED.__dict__, "n": 4})
    core = engine(llama_dir, async_scheduling=async_scheduling)
    group = core.add_request("g", prompt, params)
    assert [r.request_id for r in group.sequences] == [child_request_id("g", i) for i in range(4)]
    done = drain(core)
    got = [done[child_request_id("g", i)] for i in range(4)]
    assert got == singles(llama_dir, prompt, params)
    assert len({tuple(t) for t in got}) == 4, "seeded sequences should differ"
    assert "g" not in done and core.kv.num_free_blocks == 64  # the group's prompt is never reported


@pytest.mark.timeout(60)
def test_the_prompt_blocks_are_allocated_once(llama_dir: Path) -> None:
    core = engine(llama_dir, enable_prefix_caching=False)
    allocated = []
    allocate = core.kv.pool.allocate
    core.kv.pool.allocate = lambda n: allocated.append(n) or allocate(n)
    n, prompt = 8, PROMPT_PARTIAL
    core.add_request("g", prompt, SamplingParams(**{**SAMPLED.__dict__, "n": n, "max_tokens": 2}))
    while not any(r.output_token_ids for r in core.scheduler.running):
        core.step()
    shared = cdiv(len(prompt) - 1, BS)  # every prompt token but the last, computed once
    # ... then one private copy of the partial last block per sequence but the last one to
    # write, which keeps the original.
    assert sum(allocated) == shared + (n - 1)
    # n separate requests would have taken n * cdiv(len(prompt), BS) blocks for their prompts.
    assert 64 - core.kv.num_free_blocks == shared + n - 1 < n * cdiv(len(prompt), BS)
    drain(core)


@pytest.mark.timeout(120)
def test_a_pool_too_small_for_the_group_runs_its_sequences_in_turn(llama_dir: Path) -> None:
    """Room for one sequence at a time: the sequences that cannot get a block of their
    own give up their shared ones and recompute, and every one still matches."""
    params = SamplingParams(**{**SAMPLED.__dict__, "n": 3, "max_tokens": 20})
    need = cdiv(len(PROMPT_PARTIAL) + params.max_tokens, BS)
    core = engine(llama_dir, num_kv_blocks=need + 1)
    core.add_request("g", PROMPT_PARTIAL, params)
    done = drain(core)
    assert [done[child_request_id("g", i)] for i in range(3)] == singles(llama_dir, PROMPT_PARTIAL, params)
    assert core.kv.num_free_blocks == need + 1


@pytest.mark.timeout(60)
def test_aborting_sequences_before_the_fork(llama_dir: Path) -> None:
    core = engine(llama_dir, max_num_batched_tokens=16)  # the prompt takes 3 steps
    params = SamplingParams(**{**SAMPLED.__dict__, "n": 3})
    core.add_request("g", PROMPT_PARTIAL, params)
    core.step()
    aborted = core.abort([child_request_id("g", 1)])
    assert [r.request_id for r in aborted] == ["g-1"]
    done = drain(core)
    assert sorted(done) == ["g-0", "g-2"]
    assert [done["g-0"], done["g-2"]] == [t for i, t in enumerate(singles(llama_dir, PROMPT_PARTIAL, params))
                                          if i != 1]
    # Every sequence gone before the fork: the prompt stops too, and frees its blocks.
    core.add_request("h", PROMPT_PARTIAL, params)
    core.step()
    core.abort([child_request_id("h", i) for i in range(3)])
    assert not core.has_unfinished() and core.kv.num_free_blocks == 64


@pytest.mark.timeout(60)
def test_a_bad_group_is_refused_before_anything_is_queued(llama_dir: Path) -> None:
    core = engine(llama_dir, num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        core.add_request("g", PROMPT_PARTIAL, SamplingParams(max_tokens=40, n=2))
    core.add_request("g-1", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="'g-1' is already in use"):
        core.add_request("g", [7, 8, 9], SamplingParams(max_tokens=2, n=2))
    assert list(core.scheduler.requests) == ["g-1"]
    # A one-token prompt has nothing to share: its sequences run as they are.
    core.add_request("one", [7], SamplingParams(**{**SAMPLED.__dict__, "n": 2, "max_tokens": 3}))
    assert {k: len(v) for k, v in drain(core).items()} == {"g-1": 2, "one-0": 3, "one-1": 3}


@pytest.mark.timeout(60)
def test_a_groups_prompt_and_sequences_queue_by_its_priority_and_tag(llama_dir: Path) -> None:
    """Every request of the group (its prompt request too, which is admitted first)
    takes the group's queue order; a tag that would break the queue's order is refused."""
    core = engine(llama_dir)
    params = SamplingParams(**{**SAMPLED.__dict__, "n": 2})
    prompt = core.add_request("g", PROMPT_PARTIAL, params, priority=3, queue_tag=2.5)
    assert prompt.sequences is not None
    assert {(r.priority, r.queue_tag) for r in [prompt, *prompt.sequences]} == {(3, 2.5)}
    for tag in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="queue_tag must be a finite number >= 0"):
            core.add_request("bad", [5, 6], SamplingParams(max_tokens=2), queue_tag=tag)
    assert "bad" not in core.scheduler.requests
    drain(core)


@pytest.mark.timeout(120)
def test_one_remote_prefill_serves_the_whole_group(llama_dir: Path) -> None:
    decode, prefill = worker_pair(llama_dir, "shm")
    try:
        params = SamplingParams(**{**SAMPLED.__dict__, "n": 4})
        rp = decode.add_request("g", PROMPT_PARTIAL, params, remote=True)
        assert rp is not None and rp.request_id == "g"
        prefill.submit(rp)
        out, end = {}, time.monotonic() + 60
        while decode.engine.has_unfinished() or prefill.engine.has_unfinished():
            assert time.monotonic() < end
            for result in prefill.step():
                assert result.error is None
            for r in decode.step().finished:
                out[r.request_id] = list(r.output_token_ids)
        assert [out[child_request_id("g", i)] for i in range(4)] == singles(llama_dir, PROMPT_PARTIAL, params)
        assert decode.stats["remote"] == 1 and decode.kv_ready_at("g") is not None
    finally:  # their sockets and segments: never left to the garbage collector
        decode.transport.close()
        prefill.transport.close()


def test_a_stuck_sequence_is_unshared_by_itself_while_a_grammar_compiles_in_front_of_it() -> None:
    """Two forked sequences share the prompt's 2 blocks in a 2-block pool: each needs one
    of its own for its first write, so the ready head is stuck and gives its blocks up.
    Sequence 0's grammar is still compiling: it is set aside from in front of sequence 1
    and put back before the stuck one is taken out of `ready`, which once took the head
    (sequence 0) instead: lost from every queue, and sequence 1 queued twice."""
    from engine.kv_cache.manager import KVCacheManager
    from engine.request import Request, RequestStatus
    from engine.scheduler import Scheduler

    class Compiling:  # a grammar whose matcher is not built yet
        matcher = None

    kv = KVCacheManager(2, 4)
    scheduler = Scheduler(kv, 32, 8, max_model_len=64, eos_token_ids=[0])
    prompt_ids = [1, 2, 3, 4, 5, 6]
    sequences = [Request(f"g-{i}", list(prompt_ids), SamplingParams(max_tokens=1, ignore_eos=True)) for i in range(2)]
    prompt = Request("g", prompt_ids[:-1], SamplingParams(max_tokens=1))
    prompt.prefill_only = True
    scheduler.add_group(prompt, sequences)
    scheduler.update(scheduler.schedule(), [])  # the prompt's 5 tokens, in both blocks
    assert [r.status for r in sequences] == [RequestStatus.WAITING] * 2 and len(scheduler.remote.ready) == 2
    sequences[0].grammar = Compiling()  # type: ignore[assignment]  # only its matcher is read
    scheduler.schedule()
    queued = [r.request_id for _, r in scheduler.remote.ready] + [r.request_id for _, r in scheduler.waiting]
    assert sorted(queued) == ["g-0", "g-1"], queued  # each once: none lost, none twice
    assert scheduler.waiting[0][1].request_id == "g-1"  # unshared: it recomputes its prompt alone
    assert kv.num_held_blocks("g-1") == 0 and kv.num_held_blocks("g-0") == 2


@pytest.mark.timeout(120)
def test_forked_block_copies_work_on_an_fp8_cache(llama_dir: Path) -> None:
    """The copy-on-write of the forked partial block moves fp8 bytes (CPU torch has no
    float8 index_copy_: this step raised, failing every request in it)."""
    params = SamplingParams(**{**SAMPLED.__dict__, "n": 3})
    core = engine(llama_dir, kv_cache_dtype="fp8")
    core.add_request("g", PROMPT_PARTIAL, params)
    done = drain(core)
    got = [done[child_request_id("g", i)] for i in range(3)]
    alone = engine(llama_dir, kv_cache_dtype="fp8")
    for i in range(3):
        alone.add_request(f"s{i}", PROMPT_PARTIAL, params.child(i))
    want = drain(alone)
    assert got == [want[f"s{i}"] for i in range(3)]
