"""Async scheduling (EngineCore.step with async_scheduling=True): each call schedules and
launches step N+1 before it waits for step N's tokens. On CPU nothing overlaps, but every
piece of the logic runs: placeholder tokens filled on the device from the step in
flight, stops found one step late, blocks freed only once no queued step writes them,
synchronous steps for penalties and min_tokens, failures mid-pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 384, (n,), generator=g).tolist() for n in lengths]


def run_both(model_dir: Path, batch: list[list[int]], params: list[SamplingParams], **options):
    """Outputs (tokens, finish reason, logprobs) with and without async scheduling, and
    how many scheduled rows read a placeholder token from the step in flight."""
    results, placeholders = {}, 0
    for async_scheduling in (False, True):
        llm = LLM(str(model_dir), async_scheduling=async_scheduling, **options)
        runner, launch = llm.core.runner, llm.core.runner.launch

        def spy(scheduled, tables, *rest, launch=launch):
            nonlocal placeholders
            placeholders += sum(s.start >= s.request.num_tokens for s in scheduled)
            return launch(scheduled, tables, *rest)

        runner.launch = spy
        outs = llm.generate(batch, params, use_tqdm=False)
        results[async_scheduling] = [(o.token_ids, o.finish_reason, o.logprobs) for o in outs]
        kv = llm.core.kv
        assert kv.num_free_blocks == kv.pool.num_blocks and not llm.core.has_unfinished()
        assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    return results[False], results[True], placeholders


def test_async_matches_sync_through_preemption_chunks_and_prefix_hits(llama_dir: Path) -> None:
    shared = prompts([40], seed=1)[0]
    batch = [shared + p for p in prompts([3, 30, 70, 9], seed=2)] + prompts([100, 5, 52, 17], seed=3)
    # Greedy and seeded draws, EOS on for some, stop tokens, logprobs, varied lengths.
    params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0.0 if i % 3 else 0.9, seed=i,
                             ignore_eos=i % 2 == 0, stop_token_ids=[11, 12] if i == 5 else [],
                             logprobs=3 if i in (1, 4) else None) for i in range(len(batch))]
    # 14 blocks of 16 for ~8 x 80 tokens: preemption; a 24-token budget: chunked prompts.
    sync, async_, placeholders = run_both(llama_dir, batch, params, num_kv_blocks=14,
                                          max_num_batched_tokens=24)
    assert [out[:2] for out in async_] == [out[:2] for out in sync]
    # Logprobs only to rounding: a stop found a step later changes how later prompts are
    # cut into chunks, and so the order of their float sums.
    for (_, _, got), (_, _, want) in zip(async_, sync):
        assert (got is None) == (want is None)
        for g, w in zip(got or [], want or []):
            assert g.token_id == w.token_id and [t for t, _ in g.top] == [t for t, _ in w.top]
            assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
    assert placeholders > 20  # most decode steps ran on a token still on the device


def test_async_matches_sync_with_penalties_min_tokens_and_stop_strings(llama_dir: Path) -> None:
    batch = prompts([12, 40, 25, 8], seed=4)
    params = [SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3),
              SamplingParams(max_tokens=20, temperature=0.0, min_tokens=15, stop_token_ids=[5, 9]),
              SamplingParams(max_tokens=20, temperature=0.0, stop=["e", "a"]),
              SamplingParams(max_tokens=20, temperature=0.7, seed=3, presence_penalty=0.5)]
    sync, async_, _ = run_both(llama_dir, batch, params)
    assert async_ == sync
    # Each part of the batch also matches what it generates without the others.
    alone, _, _ = run_both(llama_dir, batch[2:3], params[2:3])
    assert alone[0] == sync[2]


def test_a_step_is_reported_by_the_next_call(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), async_scheduling=True)
    core = llm.core
    request = core.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=3, temperature=0.0,
                                                                         ignore_eos=True))
    first = core.step()  # the prompt's step is queued; nothing has come back yet
    assert first.advanced == [] and core.has_unfinished()
    assert request.num_scheduled_tokens == 20 and request.num_output_placeholders == 1
    outs = [core.step() for _ in range(3)]
    assert [len(o.advanced) for o in outs] == [1, 1, 1]
    assert outs[-1].finished == [request] and request.num_output_tokens == 3
    # Its third token was known to be its last by count: no fourth step was scheduled.
    assert not core.has_unfinished() and core.kv.num_free_blocks == core.kv.pool.num_blocks


def test_blocks_stay_held_until_the_step_in_flight_is_updated() -> None:
    sched = Scheduler(KVCacheManager(num_blocks=16, block_size=4), 64, 8, max_model_len=128)
    request = Request("a", list(range(1, 10)), SamplingParams(max_tokens=8, ignore_eos=True))
    sched.add_request(request)
    first = sched.schedule()
    second = sched.schedule()  # scheduled while `first` is in flight: one placeholder token
    assert [s.start for s in second.scheduled] == [9] and request.num_output_placeholders == 2
    sched.update(first, [7])
    free = sched.kv.num_free_blocks
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    # `second` still writes slot 9: its blocks are off the id (which a new request may
    # take) but not free yet.
    assert sched.kv.block_ids("a") == [] and sched.kv.num_free_blocks == free
    advanced, finished = sched.update(second, [8])
    assert advanced == [] and finished == [] and request.output_token_ids == [7]  # its token dropped
    assert sched.kv.num_free_blocks == 16


def test_a_failed_step_leaves_the_engine_usable(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(llama_dir), async_scheduling=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = llm.generate(prompts([15, 30], seed=5), params, use_tqdm=False)
    model = llm.core.model
    forward, calls = model.forward, 0

    def poisoned(*args, **kwargs):
        nonlocal calls
        calls += 1
        logits = forward(*args, **kwargs)
        return logits.fill_(float("nan")) if calls == 4 else logits

    monkeypatch.setattr(model, "forward", poisoned)
    with pytest.raises(RuntimeError, match="unusable logits"):
        llm.generate(prompts([15, 30], seed=5), params, use_tqdm=False)
    monkeypatch.undo()
    kv = llm.core.kv
    assert not llm.core.has_unfinished() and kv.num_free_blocks == kv.pool.num_blocks
    again = llm.generate(prompts([15, 30], seed=5), params, use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in want]


def test_an_id_aborted_in_flight_can_be_reused_at_once(llama_dir: Path) -> None:
    def engine() -> LLM:
        return LLM(str(llama_dir), async_scheduling=True, num_kv_blocks=12, block_size=8,
                   enable_prefix_caching=False)

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first, second = list(range(10, 50)), list(range(200, 237))
    want = engine().generate([second], params, use_tqdm=False)[0].token_ids
    core = engine().core
    core.add_request("x", first, params)
    for _ in range(3):
        core.step()
    core.abort(["x"])  # a step of the old "x" is in flight: its blocks are freed after it
    reused = core.add_request("x", second, params)
    core.add_request("y", list(range(300, 330)), params)  # takes whatever is freed
    while core.has_unfinished():
        core.step()
    assert reused.output_token_ids == want
    assert core.kv.num_free_blocks == core.kv.pool.num_blocks


def test_a_request_whose_last_step_is_in_flight_is_not_preempted() -> None:
    """Prefill worker: a prompt whose last chunk is in flight is done; evicting it to
    make room would throw that prompt away."""
    sched = Scheduler(KVCacheManager(num_blocks=5, block_size=4, enable_prefix_caching=False), 10, 8,
                      max_model_len=64)
    late = Request("late", list(range(1, 17)), SamplingParams(max_tokens=1), priority=1)  # 4 blocks
    early = Request("early", list(range(30, 36)), SamplingParams(max_tokens=1), priority=0)  # 2 blocks
    late.prefill_only = early.prefill_only = True
    sched.add_request(late)
    first = sched.schedule()  # late: 10 of 16 tokens
    sched.add_request(early)
    second = sched.schedule()  # late: its last 6 tokens; early: 4 of 6
    sched.update(first, [])
    third = sched.schedule()  # early needs a 6th block; late's last step is in flight
    assert [r.request_id for r in third.preempted] == ["early"] and third.scheduled == []
    _, finished = sched.update(second, [])
    assert finished == [late] and late.status == RequestStatus.PREFILLED and late.num_preemptions == 0
