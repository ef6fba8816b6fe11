"""The Scheduler's half after a step: update() with the step's sampled tokens (and
accepted drafts), discard() of a step that failed, and whether a new token ends its
request. Part of the Scheduler, kept apart to keep each file about one thing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from engine.request import Request, RequestStatus
from engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from engine.kv_cache.block_pool import KVBlock
    from engine.kv_cache.manager import KVCacheManager
    from engine.lora.slots import LoRASlots
    from engine.remote_kv import RemoteKVQueues

logger = logging.getLogger(__name__)


class SchedulerUpdates:
    """The Scheduler's after-step verbs; it provides these attributes and helpers."""

    kv: KVCacheManager
    remote: RemoteKVQueues
    running: list[Request]
    eos_token_ids: frozenset[int]
    max_model_len: int
    loras: LoRASlots
    _free_after_step: dict[Request, list[KVBlock]]

    if TYPE_CHECKING:  # the Scheduler's verbs (scheduler.py, fork_groups.py) these call
        def fork(self, prompt: Request) -> None: ...
        def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]: ...

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
                if not request.prefill_only:  # a prefill worker's blocks wait for their KV push
                    self.kv.release_out_of_window(request)  # returns at once without a sliding window
                if request.prefill_only and request.num_computed_tokens == request.num_tokens:
                    if request.sequences is not None:  # a group's prompt: its sequences go on
                        self.fork(request)
                        continue
                    self.running.remove(request)
                    self.loras.stop(request)
                    self.remote.keep_prefilled(request)
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

    def _unschedule(self, request: Request, num_tokens: int) -> None:
        """A step of the request is done (or void); free its blocks if it finished while
        that was the last step in flight."""
        request.num_scheduled_tokens -= num_tokens
        if not request.num_scheduled_tokens and request in self._free_after_step:
            self.kv.free_blocks(self._free_after_step.pop(request))

