"""The scheduler's bookkeeping of prompt KV that crosses workers, and of queued requests
that hold their blocks.

Who calls what, and when (D = decode worker, P = prefill worker; the engine core's
methods of the same names are the public verbs, each one call here):

    D   reserve(request)           EngineCore.add_remote_prefill_request, when a request
                                   arrives that a prefill worker is to prefill: blocks for
                                   its whole prompt (local prefix hits first), status
                                   WAITING_FOR_REMOTE_KV. False: they do not fit now, and
                                   the caller prefills locally (Scheduler.add_request).
    D   arrived(request)           EngineCore.remote_kv_arrived, once the transport says
                                   every prompt token's KV but the last is in its blocks:
                                   it joins `ready` (a group's prompt forks instead).
    D   failed(request)            EngineCore.remote_kv_failed, when the remote prefill
                                   gave up: it lets go of the reserved blocks (the caller
                                   first holds and fences any a late write may still land
                                   in) and waits like a preempted request.
    P   keep_prefilled(request)    Scheduler.update, when a prefill-only request's last
                                   prompt token is computed: status PREFILLED, its blocks
                                   held until the KV is written out.
    P   release_prefilled(id)      EngineCore.release_prefilled, once the KV has been
                                   written to the decode worker: its blocks are freed.
    any push_ready / head / pop    The Scheduler (schedule, and engine/fork_groups.py
                                   for forked sequences): the `ready` queue, queued
                                   requests holding their prompt's blocks, admitted ahead
                                   of the waiting queue.
    any discard(request)           Scheduler.finish_requests: a request that ends (abort,
                                   stop) leaves whichever of these it is in.

None of these runs while a step is being scheduled; none touches a running request's
blocks. A reservation never takes the blocks the head of the waiting queue needs (the
head would starve behind every reservation that comes along): see the Scheduler's
progress argument.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from engine.request import RemoteKV, Request, RequestStatus, SortKey

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


class RemoteKVQueues:
    """Reservations waiting for remote KV, the `ready` queue, and prefilled prompts."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self.kv = scheduler.kv
        # Queued requests that hold their prompt's blocks (decode worker: the remote KV
        # arrived, or the prompt is prefilled locally in them; a forked sequence).
        self.ready: list[tuple[SortKey, Request]] = []  # heap by sort_key
        # Prefill worker: requests whose prompt KV is computed; their blocks stay held
        # until the KV is written to the decode worker (release_prefilled).
        self.prefilled: dict[str, Request] = {}

    # --- decode worker ------------------------------------------------------------------

    def reserve(self, request: Request) -> bool:
        """Take blocks for the whole prompt and park the request until its KV arrives;
        False (nothing changed) if they do not fit now."""
        sched, kv = self._scheduler, self.kv
        if request.request_id in sched.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        sched.check_fits(request.num_prompt_tokens, request.sampling_params.max_tokens)
        hits = kv.get_computed_blocks(request)
        num_new = request.num_tokens - len(hits) * kv.block_size
        if kv.num_blocks_needed(request, num_new, hits) + sched.head_needs() > kv.num_free_blocks:
            return False
        if not kv.allocate_slots(request, num_new, hits):
            return False
        if kv.tiers is not None:  # the blocks' ids leave for a writer that knows nothing of our stream
            kv.tiers.settle()
        kv.count_query(request, hits)
        request.num_cached_tokens = len(hits) * kv.block_size
        # With a sliding window, the blocks before the window of the prompt's last token
        # (the first this worker computes) are never read here: let them go now, and the
        # prefill worker writes only the rest (their ids read -1 in block_ids).
        kv.release_before(request, kv.window_first_block(request.num_prompt_tokens - 1))
        # Of the rest (past the prefix hits), a block before some layer's window is written
        # only the layers that read it, and one no layer reads not at all (a draft's wider
        # window keeping it held).
        first = max(len(hits), kv.num_released(request.request_id))
        layer_first = kv.write_by_layer(request, first)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.remote = RemoteKV(first_block=min(layer_first, default=first), layer_first_blocks=layer_first)
        sched.requests[request.request_id] = request
        return True

    def arrived(self, request: Request) -> None:
        """Every prompt token but the last now has its KV: queue it to run; its first
        step computes the last prompt token and samples."""
        _expect_status(request, RequestStatus.WAITING_FOR_REMOTE_KV)
        # A group's prompt request holds every prompt token but the last: all arrived.
        prompt_of_group = request.sequences is not None
        request.num_computed_tokens = request.num_tokens - (not prompt_of_group)
        request.remote = RemoteKV(request.num_computed_tokens - request.num_cached_tokens)
        # The prefill worker wrote these blocks through to the shared store itself.
        self.kv.cache_computed_blocks(request, copied_in=True)
        if prompt_of_group:
            self._scheduler.fork(request)
        else:
            self.push_ready(request)

    def failed(self, request: Request) -> None:
        """Prefill locally after all, in new blocks; admission looks the prefix cache
        up again."""
        _expect_status(request, RequestStatus.WAITING_FOR_REMOTE_KV)
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = request.num_cached_tokens = 0
        request.remote = None
        self._scheduler.push_waiting(request)

    # --- prefill worker -----------------------------------------------------------------

    def keep_prefilled(self, request: Request) -> None:
        """Its prompt KV is computed (it has left `running`): keep its blocks."""
        request.status = RequestStatus.PREFILLED
        self.prefilled[request.request_id] = request

    def release_prefilled(self, request_id: str) -> Request:
        """The KV has been written out; free the blocks."""
        request = self.prefilled.pop(request_id, None)
        if request is None:
            raise ValueError(f"no prefilled request {request_id!r}")
        self._scheduler.requests.pop(request_id, None)
        self._scheduler.end(request, RequestStatus.FINISHED_STOPPED)
        return request

    # --- the ready queue ----------------------------------------------------------------

    def push_ready(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        heapq.heappush(self.ready, (request.sort_key, request))

    def head(self) -> Request:
        return self.ready[0][1]

    def pop(self) -> tuple[SortKey, Request]:
        return heapq.heappop(self.ready)

    def discard(self, request: Request) -> bool:
        """Take an ending request out of these queues; False: it is in none of them."""
        if request.status in (RequestStatus.WAITING_FOR_REMOTE_KV, RequestStatus.PREFILLED):
            self.prefilled.pop(request.request_id, None)
            return True
        if any(r is request for _, r in self.ready):
            self.ready = [(k, r) for k, r in self.ready if r is not request]
            heapq.heapify(self.ready)
            return True
        return False


def _expect_status(request: Request, status: RequestStatus) -> None:
    if request.status != status:
        raise ValueError(f"request {request.request_id!r} is {request.status.value}, not {status.value}")
