"""Continuous-batching scheduler with one token budget per step.

There is no prefill phase and no decode phase. Each step hands every scheduled request
a number of new tokens to compute (`num_computed_tokens` -> `num_tokens`) within
`max_num_batched_tokens`: a whole prompt, a chunk of one, or one decode token all fall
out of the same arithmetic. Running requests go first (decodes stay steady), then
waiting ones in (priority, router's fair-queuing tag, arrival) order (Request.sort_key).
With speculative decoding, running requests about to sample then take their drafts from
what is left (_add_drafts). When blocks run out, the running request last in that order
is preempted: its blocks are freed and it recomputes later (its tokens so far are kept,
and its freed blocks are usually prefix-cache hits).

Progress. Every block is held by one of: a running request (preemptible), a request
whose KV a prefill worker is writing (given up at its deadline at the latest), a
decode worker's fence over blocks a dead reservation's sender may still write (lifted
by its cancel_ack or its exit: a live sender that never answers shrinks the pool, the
one case where the engine waits on another process), a
prefill worker's computed prompt (released once written out), a queued request that
holds its blocks (`ready`: its KV arrived, or it prefills locally in them), or a step,
KV write or tier load in flight (all end; a loaded request holds its whole prompt's
blocks, engine/tier_loads.py). Ready requests need no new block for their prompt
and are admitted ahead of the waiting queue, whose requests hold no blocks; a remote
reservation never takes the blocks the head of that queue needs; and a request that
holds no blocks fits alone in an empty pool, chunked when its recompute is longer than
a step (check_fits). So whenever nothing runs, blocks keep coming free until the head
fits: the engine never stops while requests are queued. A schedule that admits
nothing with every block free breaks that argument, and raises EngineStateError.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable, Sequence

from engine.errors import EngineStateError
from engine.fork_groups import ForkGroups
from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.manager import KVCacheManager
from engine.lora.slots import LoRASlots
from engine.remote_kv import RemoteKVQueues
from engine.request import Request, RequestStatus, SortKey
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.scheduler_update import SchedulerUpdates
from engine.tier_loads import TierLoads


class Scheduler(ForkGroups, SchedulerUpdates):
    """Called by the engine core: add/abort between steps, schedule() then update().
    Groups of sequences (parallel sampling) are engine/fork_groups.py's; remote KV
    reservations, the ready queue and prefilled prompts are `remote`'s
    (engine/remote_kv.py); loads back from the KV offload tiers `loads`'
    (engine/tier_loads.py); update() and discard() are engine/scheduler_update.py's."""

    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, eos_token_ids: Sequence[int] = (),
                 enable_chunked_prefill: bool = True) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: list[tuple[SortKey, Request]] = []  # heap by sort_key; hold no blocks
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.remote = RemoteKVQueues(self)  # queued requests holding blocks: admitted first
        # Waiting requests whose prefix an offload tier is loading back (engine/tier_loads.py).
        self.loads = TierLoads(self, kv.tiers)
        self._free_after_step: dict[Request, list[KVBlock]] = {}  # finished while a step was in flight
        self.loras = LoRASlots.disabled()  # enable_lora: a running request holds its adapter's slot

    # --- admission -----------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, whole_prompt: bool = False) -> None:
        """Raise ValueError for a request that could never run, before it is queued;
        `whole_prompt`: it holds every prompt block at once (a prefill worker's), even
        with a sliding window."""
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
        self.kv.check_room(num_prompt_tokens, max_tokens, whole_prompt)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_fits(request.num_prompt_tokens, request.sampling_params.max_tokens, request.prefill_only)
        self.requests[request.request_id] = request
        self.push_waiting(request)

    def push_waiting(self, request: Request) -> None:
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
            elif not self.remote.discard(request) and not self.loads.discard(request):
                self.waiting = [(k, r) for k, r in self.waiting if r is not request]
                heapq.heapify(self.waiting)
            self.end(request, status)
            finished.append(request)
            if request.sequences:  # a group's prompt: its sequences not yet forked end with it
                waiting = [r.request_id for r in request.sequences if r.status == RequestStatus.WAITING_FOR_FORK]
                finished += self.finish_requests(waiting, status)
            elif request.group is not None:
                self._drop_unneeded_prompt(request.group)
        return finished

    def end(self, request: Request, status: RequestStatus) -> None:
        """It has left every queue: free its blocks, once no step in flight writes them."""
        request.status = status
        self.loras.stop(request)
        if request.num_scheduled_tokens:
            # A step in flight still writes its KV: free the blocks once that step is
            # done, so no other request (nor a remote KV write) gets them before. They
            # leave its id now, which a new request may take at once.
            self._free_after_step[request] = self.kv.detach(request)
        else:
            self.kv.free(request)

    @property
    def num_waiting(self) -> int:
        """Queued requests, holding blocks or not (loading their prefix back too)."""
        return len(self.waiting) + len(self.remote.ready) + len(self.loads.loading)

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
        if not any(s.request.spec is not None and s.request.spec.token_ids for s in out.scheduled):
            return budget
        for s in out.scheduled:
            request = s.request
            if request.spec is None:
                continue
            drafts, request.spec.token_ids = request.spec.token_ids, []
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
        """One step within one token budget: running requests first (decodes stay
        steady), then their drafts, then queued requests: those holding their blocks
        (ready) before those that hold none (waiting)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.loras.begin_step()
        scheduled: list[Request] = []  # running requests scheduled this step: never preempted
        for request in list(self.running):
            if budget == 0:
                break
            budget -= self._schedule_running(out, request, budget, scheduled)
        budget = self._add_drafts(out, budget)
        aside = _SteppedAside()
        budget, stuck = self._admit_ready(out, budget, aside)
        # Admitting new work while evicting running work would thrash; and while a ready
        # request waits for a step with room (chunked prefill off), later requests
        # admitted ahead of it would keep that room from ever coming.
        if not self.remote.ready and not out.preempted:
            self._admit_waiting(out, budget, aside)
        aside.put_back()
        self._close_step(out, stuck, aside)
        return out

    def _schedule_running(self, out: SchedulerOutput, request: Request, budget: int,
                          scheduled: list[Request]) -> int:
        """Schedule a running request's next tokens, preempting others (latest first)
        when blocks run out; returns the tokens it takes from the budget."""
        if request.status != RequestStatus.RUNNING:
            return 0  # preempted earlier in this step
        # Read once: this runs for every running request every step.
        start = request.num_computed_tokens + request.num_scheduled_tokens
        end = len(request.all_token_ids) + request.num_output_placeholders
        if self._nothing_to_schedule(request, start, end):
            return 0
        num_new = min(end - start, budget, self.kv.chunk_limit())
        while not self.kv.allocate_slots(request, num_new):
            # Never evict a request scheduled this step (its blocks are in use), nor
            # one whose last step is in flight (that step would be wasted).
            victim = max((r for r in self.running if r not in scheduled and not self._last_step_in_flight(r)),
                         key=lambda r: r.sort_key)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return 0
        self._schedule(out, request, start, num_new, end)
        scheduled.append(request)
        return num_new

    def _admit_ready(self, out: SchedulerOutput, budget: int,
                     aside: _SteppedAside) -> tuple[int, Request | None]:
        """Ready requests first: they hold their blocks, and running them frees them.
        Returns the budget left and the ready head whose first step's blocks do not
        fit, if one stopped the queue."""
        ready = self.remote.ready
        while ready and budget > 0 and len(self.running) < self.max_num_seqs:
            request = ready[0][1]
            if request.grammar_pending or self.loras.waits(request):
                aside.take(ready)
                continue
            num_new = self._chunk(request, request.num_tokens - request.num_computed_tokens, budget)
            if num_new is None:
                break
            if not self.kv.allocate_slots(request, num_new):
                return budget, request
            heapq.heappop(ready)
            self._admit(out, request, request.num_computed_tokens, num_new)
            budget -= num_new
        return budget, None

    def _admit_waiting(self, out: SchedulerOutput, budget: int, aside: _SteppedAside) -> None:
        """Then waiting requests, which hold no blocks: each starts from its prefix hits."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0][1]
            if request.grammar_pending or self.loras.waits(request):
                aside.take(self.waiting)
                continue
            admission = self._admission(request, budget)
            if admission is None:
                break
            hits, num_computed, num_new = admission
            if not request.needs_prompt_logprobs and self.loads.start(request, hits):
                heapq.heappop(self.waiting)  # it waits for its load, holding its blocks
                continue
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            heapq.heappop(self.waiting)
            if not request.needs_prompt_logprobs:  # else it looked nothing up
                self.kv.count_query(request, hits)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_computed
            self._admit(out, request, num_computed, num_new)
            budget -= num_new

    def _close_step(self, out: SchedulerOutput, stuck: Request | None, aside: _SteppedAside) -> None:
        """The step's block copies; a stuck forked sequence unshared; and the progress
        argument's check (module docstring)."""
        if stuck is not None and not out.scheduled and not self.running and not self._free_after_step:
            self._unshare_stuck(stuck)
        out.block_copies = self.kv.take_copies()
        if not out.scheduled and not self.running and not aside.items and self.num_waiting \
                and self.kv.num_free_blocks == self.kv.pool.num_blocks:
            head = (self.remote.ready or self.waiting)[0][1]
            raise EngineStateError(f"no progress: request {head.request_id!r} ({head.num_tokens} tokens, "
                                   f"{head.num_computed_tokens} computed) cannot be scheduled although "
                                   "nothing runs and every KV block is free")

    def _chunk(self, request: Request, num_new: int, budget: int) -> int | None:
        """Tokens of a queued request's `num_new` to compute this step within `budget`;
        None: wait for a step with more room. With chunked prefill off a prompt runs
        whole (check_fits made it fit a step), but a recompute after preemption, prompt
        plus outputs, may not fit any step: that is chunked anyway, or it could never
        come back. With a sliding window, nor may it take more than kv.chunk_limit()."""
        limit = self.kv.chunk_limit()
        if num_new <= min(budget, limit):
            return num_new
        if not self.enable_chunked_prefill and num_new <= min(self.max_num_batched_tokens, limit):
            return None
        return min(budget, limit)

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
        self.loras.start(request)
        # A draft model's KV: a prefix hit's blocks hold it as their computing request
        # left it (its drafts are only as good as that KV, never wrong: the model
        # verifies them); a prompt whose KV a prefill worker wrote, or a group's prompt
        # request computed (prefill only: it never runs the draft), has none past the
        # prefix hits it started from.
        if request.spec is not None:
            request.spec.num_draft_computed = (min(request.num_cached_tokens, num_computed)
                                               if request.num_remote_tokens or request.group is not None
                                               else num_computed)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.running.append(request)
        self._schedule(out, request, num_computed, num_new, request.num_tokens)

    def _preempt(self, request: Request) -> None:
        # Its blocks are freed even if a step in flight writes them: every later use of
        # them is queued behind that step, and they are no longer free once this step runs.
        self.running.remove(request)
        self.kv.free(request)
        self.loras.stop(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_scheduled_tokens = 0
        if request.spec is not None:
            request.spec.token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.push_waiting(request)

    def head_needs(self) -> int:
        """Free blocks the head of the waiting queue needs to be admitted (a remote
        reservation leaves them): a probe, not counted as a prefix-cache query (the
        head's admission counts its own)."""
        if not self.waiting:
            return 0
        head = self.waiting[0][1]
        admission = self._admission(head, self.max_num_batched_tokens)
        if admission is None:
            return 0
        hits, _, num_new = admission
        return self.kv.num_blocks_needed(head, num_new, hits)


class _SteppedAside:
    """Queued requests whose grammar is still compiling step aside for one schedule()
    (put back at its end), so that they hold up nobody behind them."""

    def __init__(self) -> None:
        self.items: list[tuple[list, tuple[SortKey, Request]]] = []

    def take(self, queue: list[tuple[SortKey, Request]]) -> None:
        self.items.append((queue, heapq.heappop(queue)))

    def put_back(self) -> None:
        for queue, item in self.items:
            heapq.heappush(queue, item)
