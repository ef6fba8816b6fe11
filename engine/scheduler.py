"""Continuous-batching scheduler with one token budget per step.

There is no prefill phase and no decode phase. Each step hands every scheduled request
a number of new tokens to compute (`num_computed_tokens` -> `num_tokens`) within
`max_num_batched_tokens`: a whole prompt, a chunk of one, or one decode token all fall
out of the same arithmetic. Running requests go first (decodes stay steady), then
waiting ones in (priority, arrival) order. With speculative decoding, running requests
about to sample then take their drafts from what is left (_add_drafts). When blocks run out, the lowest-priority,
latest-arriving running request is preempted: its blocks are freed and it recomputes
later (its tokens so far are kept, and its freed blocks are usually prefix-cache hits).

Progress. Every block is held by one of: a running request (preemptible), a request
whose KV a prefill worker is writing (given up at its deadline at the latest), a
decode worker's fence over blocks a dead reservation's sender may still write (lifted
by its cancel_ack or its exit: a live sender that never answers shrinks the pool, the
one case where the engine waits on another process), a
prefill worker's computed prompt (released once written out), a queued request that
holds its blocks (`ready`: its KV arrived, or it prefills locally in them), or a step
or KV write in flight (both end). Ready requests need no new block for their prompt
and are admitted ahead of the waiting queue, whose requests hold no blocks; a remote
reservation never takes the blocks the head of that queue needs; and a request that
holds no blocks fits alone in an empty pool, chunked when its recompute is longer than
a step (check_fits). So whenever nothing runs, blocks keep coming free until the head
fits: the engine never stops while requests are queued. A schedule that admits
nothing with every block free breaks that argument, and raises EngineStateError.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Iterable, Sequence

from engine.errors import DoesNotFit, EngineStateError
from engine.fork_groups import ForkGroups
from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.manager import KVCacheManager, cdiv
from engine.request import Request, RequestStatus
from engine.scheduler_output import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


class Scheduler(ForkGroups):
    """Called by the engine core: add/abort between steps, schedule() then update().
    Groups of sequences (parallel sampling) are engine/fork_groups.py's."""

    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, eos_token_ids: Sequence[int] = (),
                 enable_chunked_prefill: bool = True) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: list[tuple[tuple[int, int], Request]] = []  # heap by sort_key; hold no blocks
        # Queued requests that hold their prompt's blocks (decode worker: the remote KV
        # arrived, or the prompt is prefilled locally in them); admitted first.
        self.ready: list[tuple[tuple[int, int], Request]] = []  # heap by sort_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Prefill worker: requests whose prompt KV is computed; their blocks stay held
        # until the KV is written to the decode worker (release_prefilled).
        self.prefilled: dict[str, Request] = {}
        self._free_after_step: dict[Request, list[KVBlock]] = {}  # finished while a step was in flight

    # --- admission -----------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ValueError for a request that could never run, before it is queued."""
        if num_prompt_tokens < 1:
            raise ValueError("prompt must contain at least one token")
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {num_prompt_tokens} tokens, but the model's context "
                             f"length is {self.max_model_len} (prompt must leave room for output)")
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                             f"{num_prompt_tokens + max_tokens} exceeds the model's context length "
                             f"{self.max_model_len}")
        if not self.enable_chunked_prefill and num_prompt_tokens > self.max_num_batched_tokens:
            raise ValueError(f"prompt has {num_prompt_tokens} tokens, more than max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) with chunked prefill disabled")
        # A request alone in the engine must fit, or preemption could never make room.
        needed, pool = cdiv(num_prompt_tokens + max_tokens, self.kv.block_size), self.kv.pool.num_blocks
        if cdiv(num_prompt_tokens + 1, self.kv.block_size) > pool:
            raise DoesNotFit(f"prompt ({num_prompt_tokens} tokens) needs more than the KV pool's {pool} blocks "
                             "with its first output token; shorten the prompt or enlarge the pool", "prompt")
        if needed > pool:
            raise DoesNotFit(f"request needs {needed} KV blocks (prompt {num_prompt_tokens} + "
                             f"max_tokens {max_tokens}) but the KV pool has only "
                             f"{pool}; lower max_tokens or enlarge the pool", "max_tokens")

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_fits(request.num_prompt_tokens, request.sampling_params.max_tokens)
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(self.waiting, (request.sort_key, request))

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop on a stop string) requests wherever they are; frees blocks."""
        finished = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status in (RequestStatus.WAITING_FOR_REMOTE_KV, RequestStatus.PREFILLED):
                self.prefilled.pop(request_id, None)
            elif any(r is request for _, r in self.ready):
                self.ready = [(k, r) for k, r in self.ready if r is not request]
                heapq.heapify(self.ready)
            else:
                self.waiting = [(k, r) for k, r in self.waiting if r is not request]
                heapq.heapify(self.waiting)
            self._finish(request, status)
            finished.append(request)
            if request.sequences:  # a group's prompt: its sequences not yet forked end with it
                waiting = [r.request_id for r in request.sequences if r.status == RequestStatus.WAITING_FOR_FORK]
                finished += self.finish_requests(waiting, status)
            elif request.group is not None:
                self._drop_unneeded_prompt(request.group)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request.num_scheduled_tokens:
            # A step in flight still writes its KV: free the blocks once that step is
            # done, so no other request (nor a remote KV write) gets them before. They
            # leave its id now, which a new request may take at once.
            self._free_after_step[request] = self.kv.detach(request)
        else:
            self.kv.free(request)

    def _unschedule(self, request: Request, num_tokens: int) -> None:
        """A step of the request is done (or void); free its blocks if it finished while
        that was the last step in flight."""
        request.num_scheduled_tokens -= num_tokens
        if not request.num_scheduled_tokens and request in self._free_after_step:
            self.kv.free_blocks(self._free_after_step.pop(request))

    @property
    def num_waiting(self) -> int:
        """Queued requests, holding blocks or not."""
        return len(self.waiting) + len(self.ready)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @staticmethod
    def _schedule(out: SchedulerOutput, request: Request, start: int, num_new: int, end: int) -> None:
        """Hand the request tokens [start, start + num_new) of its `end`
        (num_tokens_with_placeholders) this step."""
        samples = start + num_new == end and not request.prefill_only
        out.scheduled.append(ScheduledRequest(request, start, num_new, samples))
        out.num_samples += samples
        # Counted before the step in flight's token lands: errs towards True for a step.
        out.reads_history |= samples and len(request.output_token_ids) < request.reads_history_until
        request.num_scheduled_tokens += num_new
        request.num_output_placeholders += samples

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Speculative decoding, once every running request has its tokens: each one
        that samples this step takes its drafts (proposed for this step only) after
        its end, as far as the budget left and the free blocks go, in running order.
        Drafts are optional: nobody is preempted for them. Returns the budget left."""
        for s in out.scheduled:
            request = s.request
            drafts, request.spec_token_ids = request.spec_token_ids, []
            if not drafts or not s.samples or budget == 0:
                continue
            drafts = drafts[:budget]
            while drafts and not self.kv.allocate_slots(request, len(drafts)):
                drafts = drafts[:-1]  # as many as the free blocks hold
            if not drafts:
                continue
            s.num_new_tokens += len(drafts)
            s.draft_token_ids = drafts
            request.num_scheduled_tokens += len(drafts)
            out.num_draft_tokens += len(drafts)
            out.reads_history = True  # the next step starts after the drafts it accepts
            budget -= len(drafts)
        return budget

    def _last_step_in_flight(self, request: Request) -> bool:
        return self._nothing_to_schedule(request, request.num_started_tokens,
                                         request.num_tokens_with_placeholders)

    def _nothing_to_schedule(self, request: Request, start: int, end: int) -> bool:
        """A running request (next token `start`, `end` tokens with placeholders) has
        nothing left to schedule: a step in flight computes the rest of its prompt on a
        prefill worker, or samples its last token by count (max_tokens, context
        length); another step would run past both."""
        if start == end:
            return True
        placeholders = request.num_output_placeholders
        if not placeholders:
            return False
        return (len(request.output_token_ids) + placeholders >= request.sampling_params.max_tokens
                or end >= self.max_model_len)

    # --- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_running: list[Request] = []

        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            # Read once: this runs for every running request every step.
            start = request.num_computed_tokens + request.num_scheduled_tokens
            end = len(request.all_token_ids) + request.num_output_placeholders
            if self._nothing_to_schedule(request, start, end):
                continue
            num_new = min(end - start, budget)
            while not self.kv.allocate_slots(request, num_new):
                # Never evict a request scheduled this step (its blocks are in use), nor
                # one whose last step is in flight (that step would be wasted).
                victim = max((r for r in self.running
                              if r not in scheduled_running and not self._last_step_in_flight(r)),
                             key=lambda r: r.sort_key)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            self._schedule(out, request, start, num_new, end)
            scheduled_running.append(request)
            budget -= num_new
        if scheduled_running and any(r.spec_token_ids for r in scheduled_running):
            budget = self._add_drafts(out, budget)

        # Requests whose grammar is still compiling step aside (put back below), so that
        # they hold up nobody behind them.
        compiling: list[tuple[list, tuple[tuple[int, int], Request]]] = []

        # Ready requests first: they hold their blocks, and running them frees them.
        stuck: Request | None = None  # a ready head whose first step's blocks do not fit
        while self.ready and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.ready[0][1]
            if request.grammar_pending:
                compiling.append((self.ready, heapq.heappop(self.ready)))
                continue
            num_new = self._chunk(request, request.num_tokens - request.num_computed_tokens, budget)
            if num_new is None:
                break
            if not self.kv.allocate_slots(request, num_new):
                stuck = request
                break
            heapq.heappop(self.ready)
            self._admit(out, request, request.num_computed_tokens, num_new)
            budget -= num_new

        # Admitting new work while evicting running work would thrash; and while a ready
        # request waits for a step with room (chunked prefill off), later requests
        # admitted ahead of it would keep that room from ever coming.
        while self.waiting and not self.ready and budget > 0 and not out.preempted \
                and len(self.running) < self.max_num_seqs:
            request = self.waiting[0][1]
            if request.grammar_pending:
                compiling.append((self.waiting, heapq.heappop(self.waiting)))
                continue
            admission = self._admission(request, budget)
            if admission is None:
                break
            hits, num_computed, num_new = admission
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            heapq.heappop(self.waiting)
            if not request.needs_prompt_logprobs:
                self.kv.count_query(request, hits)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_computed
            self._admit(out, request, num_computed, num_new)
            budget -= num_new

        for queue, item in compiling:
            heapq.heappush(queue, item)
        if stuck is not None and not out.scheduled and not self.running and not self._free_after_step:
            self._unshare_stuck(stuck)
        out.block_copies = self.kv.take_copies()
        if not out.scheduled and not self.running and not compiling and (self.waiting or self.ready) \
                and self.kv.num_free_blocks == self.kv.pool.num_blocks:
            head = (self.ready or self.waiting)[0][1]
            raise EngineStateError(f"no progress: request {head.request_id!r} ({head.num_tokens} tokens, "
                                   f"{head.num_computed_tokens} computed) cannot be scheduled although "
                                   "nothing runs and every KV block is free")
        return out

    def _chunk(self, request: Request, num_new: int, budget: int) -> int | None:
        """Tokens of a queued request's `num_new` to compute this step within `budget`;
        None: wait for a step with more room. With chunked prefill off a prompt runs
        whole (check_fits made it fit a step), but a recompute after preemption, prompt
        plus outputs, may not fit any step: that is chunked anyway, or it could never
        come back."""
        if num_new <= budget:
            return num_new
        if not self.enable_chunked_prefill and num_new <= self.max_num_batched_tokens:
            return None
        return budget

    def _admission(self, request: Request, budget: int) -> tuple[list[KVBlock], int, int] | None:
        """(prefix hits, tokens they cover, tokens to compute now) for a waiting request,
        which holds no blocks; None if it must wait for a step with more room."""
        if request.num_computed_tokens or self.kv.num_held_blocks(request.request_id):
            raise EngineStateError(f"waiting request {request.request_id!r} holds blocks or computed tokens "
                                   "(it belongs in `ready`)")
        # Cached positions have no logits: prompt logprobs need the prompt computed.
        hits = [] if request.needs_prompt_logprobs else self.kv.get_computed_blocks(request)
        num_computed = len(hits) * self.kv.block_size
        num_new = self._chunk(request, request.num_tokens - num_computed, budget)
        return None if num_new is None else (hits, num_computed, num_new)

    def _admit(self, out: SchedulerOutput, request: Request, num_computed: int, num_new: int) -> None:
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.RUNNING
        # A draft model's KV: a prefix hit's blocks hold it as their computing request
        # left it (its drafts are only as good as that KV, never wrong: the model
        # verifies them); a prompt whose KV a prefill worker wrote, or a group's prompt
        # request computed (prefill only: it never runs the draft), has none past the
        # prefix hits it started from.
        request.num_draft_computed = (min(request.num_cached_tokens, num_computed)
                                      if request.num_remote_tokens or request.group is not None
                                      else num_computed)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.running.append(request)
        self._schedule(out, request, num_computed, num_new, request.num_tokens)

    # --- disaggregation ----------------------------------------------------------------

    def reserve_for_remote_prefill(self, request: Request) -> bool:
        """Decode worker: take blocks for the whole prompt (local prefix hits first) and
        park the request until its KV arrives. False (nothing changed) if they don't fit
        now; the caller then prefills locally (add_request)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_fits(request.num_prompt_tokens, request.sampling_params.max_tokens)
        hits = self.kv.get_computed_blocks(request)
        num_new = request.num_tokens - len(hits) * self.kv.block_size
        # Never take the blocks the head of the queue waits for (it would starve behind
        # every reservation that comes along).
        if self.kv.num_blocks_needed(request, num_new, hits) + self._head_needs() > self.kv.num_free_blocks:
            return False
        if not self.kv.allocate_slots(request, num_new, hits):
            return False
        self.kv.count_query(request, hits)
        request.num_cached_tokens = len(hits) * self.kv.block_size
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        return True

    def _head_needs(self) -> int:
        """Free blocks the head of the waiting queue needs to be admitted: a probe, not
        counted as a prefix-cache query (the head's admission counts its own)."""
        if not self.waiting:
            return 0
        head = self.waiting[0][1]
        admission = self._admission(head, self.max_num_batched_tokens)
        if admission is None:
            return 0
        hits, _, num_new = admission
        return self.kv.num_blocks_needed(head, num_new, hits)

    def remote_kv_arrived(self, request: Request) -> None:
        """Every prompt token but the last now has its KV: queue it to run; its first
        step computes the last prompt token and samples."""
        self._expect_status(request, RequestStatus.WAITING_FOR_REMOTE_KV)
        # A group's prompt request holds every prompt token but the last: all arrived.
        request.num_computed_tokens = request.num_tokens - (request.sequences is None)
        request.num_remote_tokens = request.num_computed_tokens - request.num_cached_tokens
        self.kv.cache_computed_blocks(request)
        if request.sequences is not None:
            self._fork(request)
        else:
            self._push_ready(request)

    def remote_kv_failed(self, request: Request) -> None:
        """Prefill locally after all, in new blocks: the request lets go of the blocks
        it reserved (a remote write may still land in those: the caller holds them out
        of use, fenced, until it cannot) and waits like a preempted request, whose
        admission looks the prefix cache up again."""
        self._expect_status(request, RequestStatus.WAITING_FOR_REMOTE_KV)
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = request.num_cached_tokens = 0
        self._push_waiting(request)

    def _push_ready(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        heapq.heappush(self.ready, (request.sort_key, request))

    def release_prefilled(self, request_id: str) -> Request:
        """Prefill worker: the KV has been written out; free the blocks."""
        request = self.prefilled.pop(request_id, None)
        if request is None:
            raise ValueError(f"no prefilled request {request_id!r}")
        self.requests.pop(request_id, None)
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        return request

    @staticmethod
    def _expect_status(request: Request, status: RequestStatus) -> None:
        if request.status != status:
            raise ValueError(f"request {request.request_id!r} is {request.status.value}, not {status.value}")

    def _preempt(self, request: Request) -> None:
        # Its blocks are freed even if a step in flight writes them: every later use of
        # them is queued behind that step, and they are no longer free once this step runs.
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_scheduled_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(request)

    def update(self, out: SchedulerOutput, sampled: Sequence[int],
               num_accepted: Sequence[int] | None = None) -> tuple[list[Request], list[Request]]:
        """Advance the requests of a step that has run and append their sampled tokens.

        `sampled`: one token per ScheduledRequest with `samples`, in `out.scheduled`
        order. With async scheduling, the next step has been scheduled already: a
        request may have been preempted since (its token still counts), finished or
        aborted (its token is dropped). Returns (requests that got a new token,
        requests that finished in this update).

        `num_accepted` (speculative decoding, aligned with `sampled`): how many of each
        request's drafts were accepted. They come first; its sampled token follows
        them. The KV of its rejected drafts stays in its blocks, unhashed, and the
        next step overwrites it.
        """
        if len(sampled) != out.num_samples:
            raise ValueError(f"{len(sampled)} sampled tokens for {out.num_samples} sampling requests")
        advanced, finished = [], []
        tokens = iter(sampled)
        accepted = iter(num_accepted) if num_accepted is not None else None
        for s in out.scheduled:
            request = s.request
            token = next(tokens) if s.samples else None
            num_drafts = len(s.draft_token_ids)
            status, appended = None, 0
            if s.samples and accepted is not None:
                status, appended = self._append_drafts(request, s.draft_token_ids[:next(accepted)])
            if request.status == RequestStatus.RUNNING:
                request.num_scheduled_tokens -= s.num_new_tokens
                # Of its drafts, only the accepted ones' KV counts as computed.
                request.num_computed_tokens += s.num_new_tokens - num_drafts + appended
                self.kv.cache_computed_blocks(request)  # returns at once without prefix caching
                if request.prefill_only and request.num_computed_tokens == request.num_tokens:
                    if request.sequences is not None:  # a group's prompt: its sequences go on
                        self._fork(request)
                        continue
                    self.running.remove(request)
                    request.status = RequestStatus.PREFILLED
                    self.prefilled[request.request_id] = request
                    finished.append(request)
                    continue
            elif request.status.finished:
                self._unschedule(request, s.num_new_tokens)
                continue
            # else preempted after this step was scheduled: it recomputes, but its token stands
            if status is not None:  # a draft it accepted ended it: the token sampled after is moot
                request.num_output_placeholders -= 1
                self.finish_requests([request.request_id], status)
                advanced.append(request)
                finished.append(request)
                continue
            if token is None:
                continue  # a prompt chunk: nothing to sample yet
            request.num_output_placeholders -= 1
            request.append_output_token(token)
            advanced.append(request)
            status = self._stop_status(request, token)
            if status is not None:
                self.finish_requests([request.request_id], status)
                finished.append(request)
        return advanced, finished

    def _append_drafts(self, request: Request, drafts: Sequence[int]) -> tuple[RequestStatus | None, int]:
        """Append a request's accepted drafts (unless it has finished) up to the first
        that ends it: (how it ended, or None; drafts appended)."""
        if request.status.finished:
            return None, 0
        for i, token in enumerate(drafts):
            request.append_output_token(token)
            status = self._stop_status(request, token)
            if status is not None:
                return status, i + 1
        return None, len(drafts)

    def discard(self, out: SchedulerOutput) -> None:
        """Forget a scheduled step that failed before update(): its requests stand as if
        it had never been scheduled, and compute those tokens again. Once per step."""
        for s in out.scheduled:
            request = s.request
            request.num_output_placeholders -= s.samples
            if request.status != RequestStatus.PREEMPTED:  # else reset when it was preempted
                self._unschedule(request, s.num_new_tokens)

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        """How `token`, just appended, ends the request, if it does (runs for every
        sampling request every step)."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        grammar = request.grammar
        if grammar is not None:
            if not grammar.accept(token):  # the mask allowed it, so only a bug gets here
                logger.error("request %s: token %d does not follow its grammar; aborted",
                             request.request_id, token)
                return RequestStatus.FINISHED_ABORTED
            if grammar.terminated:  # a grammar that has ended finishes its request
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.min_tokens:
            if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or len(request.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
