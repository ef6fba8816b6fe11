"""Scheduler behaviour with a real KV cache manager and fake model outputs (no torch)."""

from __future__ import annotations

import pytest

from engine.errors import DoesNotFit
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus, Speculation
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

EOS = 0


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 32, max_seqs: int = 8,
                   chunked: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(kv, budget, max_seqs, max_model_len=512, eos_token_ids=[EOS],
                     enable_chunked_prefill=chunked)


def add(sched: Scheduler, rid: str, n_prompt: int, max_tokens: int = 4, priority: int = 0,
        first_token: int = 1, queue_tag: float = 0.0) -> Request:
    req = Request(rid, list(range(first_token, first_token + n_prompt)),
                  SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority, queue_tag=queue_tag)
    sched.add_request(req)
    return req


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, [token] * out.num_samples)
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished:
        outs.append(step(sched))
        assert len(outs) < max_steps, "scheduler made no progress"
        assert all(b.ref_cnt >= 0 for b in sched.kv.pool.blocks)
    return outs


def test_budget_chunks_long_prompt_and_samples_only_at_the_end() -> None:
    sched = make_scheduler(budget=10)
    req = add(sched, "a", 25)
    outs = [step(sched) for _ in range(3)]
    assert [o.num_tokens for o in outs] == [10, 10, 5]
    assert [o.scheduled[0].samples for o in outs] == [False, False, True]
    assert req.output_token_ids == [7] and req.num_computed_tokens == 25


def test_decodes_first_then_prefills_share_the_budget() -> None:
    sched = make_scheduler(budget=8)
    add(sched, "a", 3)
    step(sched)  # a prefilled, now decoding
    add(sched, "b", 20)
    out = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]


def test_without_chunking_long_prompt_is_rejected_and_short_waits_for_budget() -> None:
    sched = make_scheduler(budget=8, chunked=False)
    with pytest.raises(ValueError, match="chunked prefill disabled"):
        add(sched, "big", 9)
    add(sched, "a", 6)
    add(sched, "b", 6)
    out = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a"]  # b does not fit unchunked


def test_max_num_seqs_caps_running() -> None:
    sched = make_scheduler(max_seqs=2)
    for i in range(4):
        add(sched, f"r{i}", 3)
    out = step(sched)
    assert len(out.scheduled) == 2 and len(sched.running) == 2


def test_priority_orders_admission() -> None:
    sched = make_scheduler(max_seqs=1)
    add(sched, "low", 3, priority=5)
    add(sched, "high", 3, priority=-1)
    assert step(sched).scheduled[0].request.request_id == "high"


def test_queue_tag_orders_admission_within_a_priority_and_priority_comes_first() -> None:
    """The router's fair-queuing tag: a later request of a lower tag runs first, ties go
    by arrival, and a better priority beats any tag."""
    sched = make_scheduler(max_seqs=1)
    add(sched, "tag-2", 3, queue_tag=2.0, first_token=1)
    add(sched, "tag-1", 3, queue_tag=1.0, first_token=10)
    add(sched, "tag-1-later", 3, queue_tag=1.0, first_token=20)
    add(sched, "urgent-tag-9", 3, priority=-1, queue_tag=9.0, first_token=30)
    order: list[str] = []
    for out in run_to_completion(sched):
        order += [s.request.request_id for s in out.scheduled if s.request.request_id not in order]
    assert order == ["urgent-tag-9", "tag-1", "tag-1-later", "tag-2"]


def test_preemption_recomputes_and_everything_finishes() -> None:
    # 6 blocks of 4 tokens: three 6-token prompts growing to 14 tokens cannot all fit.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=32)
    reqs = [add(sched, f"r{i}", 6, max_tokens=8, first_token=10 * i + 1) for i in range(3)]
    run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert max(r.num_preemptions for r in reqs) > 0
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 8 for r in reqs)
    assert sched.kv.num_free_blocks == 6


def test_victim_is_latest_arrival() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, budget=32)
    first = add(sched, "first", 7, max_tokens=8, first_token=1)
    second = add(sched, "second", 7, max_tokens=8, first_token=100)
    while not second.num_preemptions and sched.has_unfinished:
        step(sched)
    assert second.num_preemptions == 1 and first.num_preemptions == 0


def test_request_that_can_never_fit_is_rejected_up_front() -> None:
    """Refused by name: the field to change, as the client's 400 says it (param)."""
    sched = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(DoesNotFit, match="KV pool has only 4; lower max_tokens") as err:
        add(sched, "huge", 10, max_tokens=10)
    assert err.value.param == "max_tokens"
    with pytest.raises(DoesNotFit, match="prompt \\(16 tokens\\) needs more than the KV pool's 4 blocks") as err:
        add(sched, "wide", 16, max_tokens=1)
    assert err.value.param == "prompt"
    with pytest.raises(ValueError, match="context length"):
        add(sched, "long", 600)
    assert not sched.has_unfinished


def test_abort_waiting_and_running_frees_blocks() -> None:
    sched = make_scheduler(max_seqs=1)
    a = add(sched, "a", 9)
    b = add(sched, "b", 9)
    step(sched)
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished and sched.kv.num_free_blocks == 64


def test_eos_stops_unless_ignored_and_min_tokens_holds_it() -> None:
    sched = make_scheduler()
    req = Request("e", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=2))
    sched.add_request(req)
    step(sched, token=EOS)  # below min_tokens: not a stop (the sampler would have masked it)
    assert req.status == RequestStatus.RUNNING
    step(sched, token=EOS)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.output_token_ids == [EOS, EOS]


def test_prefix_hits_skip_computation() -> None:
    sched = make_scheduler(block_size=4)
    add(sched, "a", 12)
    run_to_completion(sched)
    b = add(sched, "b", 14)  # same first 12 tokens
    out = step(sched)
    assert b.num_cached_tokens == 12 and out.scheduled[0].num_new_tokens == 2


def test_update_refuses_a_token_count_that_does_not_match_the_step() -> None:
    sched = make_scheduler()
    req = add(sched, "a", 3)
    out = sched.schedule()
    with pytest.raises(ValueError, match="2 sampled tokens for 1 sampling requests"):
        sched.update(out, [7, 7])
    assert req.output_token_ids == [] and req.num_computed_tokens == 0  # nothing applied
    sched.update(out, [7])
    assert req.output_token_ids == [7]


def test_a_step_reads_history_while_a_sampling_request_has_penalties_or_min_tokens_unmet() -> None:
    sched = make_scheduler()
    plain = add(sched, "plain", 3, max_tokens=8)
    assert not step(sched).reads_history
    sched.add_request(Request("min", [5, 6, 7], SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True)))
    out = step(sched)  # min's prompt: its first token is sampled with eos masked
    assert out.reads_history
    assert step(sched).reads_history  # one token out, min_tokens 2
    assert not step(sched).reads_history  # two out: the mask is off
    sched.add_request(Request("pen", [8, 9], SamplingParams(max_tokens=8, presence_penalty=0.5)))
    assert all(step(sched).reads_history for _ in range(3))  # penalties read every token so far
    assert plain.status == RequestStatus.RUNNING


def test_drafts_that_do_not_fit_are_dropped_before_anyone_is_preempted() -> None:
    """Speculative decoding: drafts are optional. A request whose drafts need a block
    the pool does not have runs without them; nobody is preempted for them."""
    sched = make_scheduler(num_blocks=2, block_size=4)
    a, _ = add(sched, "a", 3, max_tokens=5), add(sched, "b", 3, max_tokens=5, first_token=20)
    step(sched)  # both prompts; each has 4 tokens in its one block
    a.spec = Speculation([5, 6])  # would need a second block for a
    out = sched.schedule()
    assert not out.preempted and out.num_draft_tokens == 0
    assert [(s.request.request_id, s.num_new_tokens, tuple(s.draft_token_ids)) for s in out.scheduled] == \
        [("a", 1, ()), ("b", 1, ())]
    sched.update(out, [7, 7], [0, 0])
    assert a.output_token_ids == [7, 7] and a.num_computed_tokens == 4


def test_accepted_drafts_advance_and_a_stop_among_them_ends_the_request() -> None:
    sched = make_scheduler(block_size=4)
    a = add(sched, "a", 3, max_tokens=8)
    step(sched)
    a.spec = Speculation([5, 6, 9])
    out = sched.schedule()
    assert (out.scheduled[0].num_new_tokens, list(out.scheduled[0].draft_token_ids)) == (4, [5, 6, 9])
    sched.update(out, [11], [2])  # 5 and 6 accepted, 11 sampled in place of 9
    assert a.output_token_ids == [7, 5, 6, 11] and a.num_computed_tokens == 6 and a.num_tokens == 7
    a.sampling_params.stop_token_ids = [8]
    a.spec = Speculation([12, 8, 13])
    out = sched.schedule()
    _, finished = sched.update(out, [14], [3])  # the stop token 8 ends it; 13 and 14 are dropped
    assert finished == [a] and a.output_token_ids == [7, 5, 6, 11, 12, 8] and a.status == RequestStatus.FINISHED_STOPPED
    assert sched.kv.num_free_blocks == 64


def test_drafts_come_after_every_running_requests_token() -> None:
    """One request's drafts never take the block or the budget another running
    request needs for its one token (it would be preempted or skipped for them)."""
    sched = make_scheduler(num_blocks=5, block_size=4)
    a, _ = add(sched, "a", 7, max_tokens=8), add(sched, "b", 8, max_tokens=8, first_token=20)
    step(sched)  # a holds 2 blocks (its next token fits), b 2 (its next token needs a third)
    a.spec = Speculation([5, 6, 9])
    out = sched.schedule()
    assert not out.preempted
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1)]
    sched.update(out, [7, 7], [0, 0])
    # The budget: b's token first, then as many of a's drafts as are left room for.
    sched = make_scheduler(budget=3, block_size=4)
    a, _ = add(sched, "a", 2, max_tokens=8), add(sched, "b", 1, max_tokens=8, first_token=20)
    step(sched)
    a.spec = Speculation([5, 6, 9])
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens, list(s.draft_token_ids)) for s in out.scheduled] == \
        [("a", 2, [5]), ("b", 1, [])]
