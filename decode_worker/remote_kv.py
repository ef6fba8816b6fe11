"""The decode worker's side of a remote prefill: reserve, receive, or fall back.

add_request(..., remote=True) reserves blocks for the prompt and returns the
RemotePrefill to send to a prefill worker. step() polls the transport: a Completed
reservation makes the request runnable (its first step computes the last prompt token
and samples).

The fence. From the reservation until its KV is Completed, the blocks a prefill worker
writes are fenced in the engine (EngineCore.fence_blocks): a step that would read one
raises instead. A reservation given up on (Expired, the prefill worker's failure or
death, an abort) keeps its blocks fenced and held out of the pool (hold_blocks) until
the transport Releases them: on the sender's cancel_ack or its exit, never on a timer
(kv_transfer/receiver.py). The request does not wait for that: it prefills locally in
new blocks at once (EngineCore.remote_kv_failed), or ends at once (abort). A sender
that lives but never answers so holds blocks for as long as it lives. Once it has left
a given-up reservation unconfirmed, it gets a new prompt from here only while its
fenced and in-flight blocks stay within QUARANTINE_LIMIT of the pool
(accepts_prompts_from): it can hold at most that plus one reservation, or what was in
flight to it when its first reservation was given up (router.prefill_max_outstanding
prompts at most), whichever is more.

Should a one-sided write land after all in blocks already released (Overwritten: a
transport that broke the fence), their contents are unknown: step() tells the engine
(EngineCore.invalidate_blocks: they leave the prefix cache), aborts every request
holding one (reported among the step's finished requests, status abort), and lists
those in `corrupted`, which the caller drains to have the router retry each
(decode_worker/server.py). With the fence this never happens; it stays as the alarm.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from engine.engine_core import EngineCore, StepOutput
from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.manager import cdiv
from engine.kv_cache.window import layer_masks
from engine.request import Request
from engine.sampling_params import SamplingParams
from kv_transfer import Completed, Expired, KVTransport, Overwritten, Released
from protocol import LoRASpec, RemotePrefill
from workers.step_metrics import StepMetrics

logger = logging.getLogger(__name__)

# A prefill worker whose given-up reservations hold more than this share of the pool
# (it does not confirm them: stopped, or wedged) gets no new prompt from this worker.
QUARANTINE_LIMIT = 0.25


@dataclass
class _RemoteKV:
    """A request whose prompt KV was (or is being) pushed here."""

    epoch: int
    sender: str | None
    first: int  # the reservation: the request's blocks [first, end)
    end: int
    blocks: list[int]  # their ids, fenced until Completed or Released
    waiting: bool = True  # for its KV: it has neither arrived nor been given up on
    ready_at: float | None = None  # time.monotonic() its pushed KV completed


@dataclass
class _Fence:
    """A given-up reservation's blocks, held out of the pool until Released."""

    sender: str | None
    blocks: list[KVBlock]


class DecodeWorkerCore:
    """Drives one engine (role: decode) and one transport. Call step() in a loop."""

    def __init__(self, engine: EngineCore, transport: KVTransport, deadline_s: float = 30.0) -> None:
        self.engine = engine
        self.transport = transport
        self.deadline_s = deadline_s
        self.block_size = engine.config.block_size
        self._remote: dict[str, _RemoteKV] = {}  # forget() drops a request's
        self._fences: dict[tuple[str, int], _Fence] = {}  # (request, epoch) -> held blocks
        self._quarantine_limit = QUARANTINE_LIMIT * engine.stats().num_blocks  # blocks: the pool's size is fixed
        # Unique per reservation, so a late write for an earlier one under a reused
        # request id is never taken for the new one's.
        self._epochs = itertools.count(1)
        self.stats = dict(remote=0, local=0, fallbacks=0, fenced_refusals=0)
        self.steps = StepMetrics()  # its engine steps' time and batch (stats replies)
        # Requests aborted because a late KV write overwrote blocks they hold (their KV is
        # corrupt): the caller takes them from here (and clears it) and fails each one
        # with an error to its client. Already aborted here: nothing more of them runs.
        self.corrupted: list[str] = []

    @property
    def waiting_for_kv(self) -> set[str]:
        """The requests whose pushed KV has neither arrived nor been given up on."""
        return {r for r, kv in self._remote.items() if kv.waiting}

    def is_waiting_for_kv(self, request_id: str) -> bool:
        kv = self._remote.get(request_id)
        return kv is not None and kv.waiting

    def kv_ready_at(self, request_id: str) -> float | None:
        """When the request's pushed KV completed (time.monotonic()); None: it did not
        (prefilled here)."""
        kv = self._remote.get(request_id)
        return None if kv is None else kv.ready_at

    def quarantined_blocks(self, sender: str | None = None) -> int:
        """Blocks held out of the pool for given-up reservations (of `sender`, or all)."""
        return sum(len(f.blocks) for f in self._fences.values() if sender is None or f.sender == sender)

    def accepts_prompts_from(self, sender: str) -> bool:
        """False once `sender` has left given-up reservations unconfirmed and those,
        with its reservations in flight (which may end the same way), hold more than
        QUARANTINE_LIMIT of the pool: another prompt to it could starve this worker. A
        sender with none unconfirmed is not suspect, however much it has in flight."""
        fenced = self.quarantined_blocks(sender)
        if not fenced:
            return True
        in_flight = sum(len(kv.blocks) for kv in self._remote.values() if kv.waiting and kv.sender == sender)
        return fenced + in_flight <= self._quarantine_limit

    def forget(self, request_id: str) -> None:
        """The request has ended and been reported: drop what is kept of it (not while
        it waits for its KV)."""
        if not self.is_waiting_for_kv(request_id):
            self._remote.pop(request_id, None)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    remote: bool, priority: int = 0, sender: str | None = None,
                    resumed: int = 0, queue_tag: float = 0.0, lora: LoRASpec | None = None) -> RemotePrefill | None:
        """Queue a request. With remote=True and blocks to spare, returns what the prefill
        worker must do (with the request's priority and queue_tag, which order its queue
        there); None means it prefills here. `sender`: the prefill worker's agent name
        (one-sided transports need it: they fence on it). `resumed`, `queue_tag`:
        EngineCore.add_request's; `lora`: its adapter, which the prefill worker computes
        the prompt's KV with too (reading it from its path if it holds no read of it)."""
        lora_request = lora.request() if lora is not None else None
        if remote and sender is not None and not self.accepts_prompts_from(sender):
            self.stats["fenced_refusals"] += 1
            remote = False
        if remote and len(prompt_token_ids) >= 2:
            request = self.engine.add_remote_prefill_request(request_id, prompt_token_ids, params, priority,
                                                             resumed, queue_tag=queue_tag, lora_request=lora_request)
            if request is not None:
                return self._expect(request, prompt_token_ids, sender, lora)
        self.engine.add_request(request_id, prompt_token_ids, params, priority, resumed, queue_tag=queue_tag,
                                lora_request=lora_request)
        self.stats["local"] += 1
        return None

    def _expect(self, request: Request, prompt: list[int], sender: str | None,
                lora: LoRASpec | None) -> RemotePrefill | None:
        request_id = request.request_id
        blocks = self.engine.block_ids(request_id)
        # Blocks this worker holds already (prefix-cache hits), or whose KV no layer reads
        # (out of the window), are not written; and each layer is written from the first
        # block it reads (a mixed model's local layers: their window's).
        assert request.remote is not None  # the engine's reservation (engine/remote_kv.py)
        first, layer_first = request.remote.first_block, request.remote.layer_first_blocks
        end = cdiv(len(prompt) - 1, self.block_size)
        if first >= end:  # the local prefix cache already holds it all
            self.engine.remote_kv_arrived(request_id)
            self.stats["local"] += 1
            return None
        epoch = next(self._epochs)
        deadline = time.time() + self.deadline_s
        # A mixed local/global model: the blocks before the local layers' window are
        # written (and awaited) for the global layers only.
        masks = layer_masks(layer_first, first, end) if layer_first else None
        self.transport.expect(request_id, epoch, blocks[first:end], deadline, sender, masks)
        self.engine.fence_blocks(blocks[first:end])
        self._remote[request_id] = _RemoteKV(epoch, sender, first, end, blocks[first:end])
        self.stats["remote"] += 1
        return RemotePrefill(request_id=request_id, prompt_token_ids=list(prompt), peer=self.transport.agent_name,
                             block_ids=blocks, first_block=first, epoch=epoch, deadline=deadline,
                             session=self.transport.session, priority=request.priority, queue_tag=request.queue_tag,
                             layer_first_blocks=list(layer_first), lora=lora)

    def _give_up(self, request_id: str, abort: bool) -> list[Request]:
        """Stop waiting for the request's pushed KV: its reserved blocks stay held and
        fenced until Released; the request prefills locally in new blocks, or ends
        (abort: returned)."""
        kv = self._remote[request_id]
        kv.waiting = False
        held = self.engine.hold_blocks(request_id, kv.first, kv.end)
        self._fences[(request_id, kv.epoch)] = _Fence(kv.sender, held)
        if abort:
            del self._remote[request_id]  # ended: nobody reports it
            return self.engine.abort([request_id])
        self.stats["fallbacks"] += 1
        self.engine.remote_kv_failed(request_id)
        return []

    def prefill_failed(self, request_id: str) -> None:
        """The prefill worker reported failure (or died): prefill locally instead."""
        if self.is_waiting_for_kv(request_id):
            self.transport.abort(request_id)
            self._give_up(request_id, abort=False)

    def abort(self, request_id: str) -> list[Request]:
        """End a request now; returns it if it was queued or running. The blocks a
        prefill worker was writing stay fenced until the transport releases them."""
        if self.is_waiting_for_kv(request_id):
            self.transport.abort(request_id)
            return self._give_up(request_id, abort=True)
        return self.engine.abort([request_id])

    def step(self) -> StepOutput:
        ended = []  # aborted here for an overwritten block: reported as finished (aborted)
        for event in self.transport.poll():
            if isinstance(event, Overwritten):
                ended += self._overwritten(event)
            elif isinstance(event, Released):
                self._released(event.req, event.epoch)
            else:
                kv = self._remote.get(event.req)
                if kv is None or not kv.waiting or kv.epoch != event.epoch:
                    continue
                if isinstance(event, Completed):
                    kv.waiting, kv.ready_at = False, time.monotonic()
                    self.engine.unfence_blocks(kv.blocks)
                    self.engine.remote_kv_arrived(event.req)
                elif isinstance(event, Expired):
                    logger.warning("the KV of %s's remote prefill did not arrive within prefill_deadline_s "
                                   "(%g s): it is prefilled here instead (an overloaded prefill pool? raise "
                                   "prefill_deadline_s or add prefill workers)", event.req, self.deadline_s)
                    self._give_up(event.req, abort=False)
        out = self.steps.step(self.engine) if self.engine.has_unfinished() else StepOutput()
        out.finished += ended
        return out

    def _released(self, request_id: str, epoch: int) -> None:
        """Nothing can land in the reservation's blocks any more: they go back."""
        kv = self._remote.get(request_id)
        if kv is not None and kv.waiting and kv.epoch == epoch:  # released before it was given up on
            self._give_up(request_id, abort=False)
        fence = self._fences.pop((request_id, epoch), None)
        if fence is not None:
            self.engine.unfence_blocks([b.block_id for b in fence.blocks])
            self.engine.release_blocks(fence.blocks)

    def _overwritten(self, event: Overwritten) -> list[Request]:
        """A late write of released reservation (event.req, event.epoch) landed in
        event.blocks: whatever they hold now is unknown."""
        holders = self.engine.invalidate_blocks(list(event.blocks))
        if event.fenced and not holders:  # the fence held: nobody reads them before they come back
            return []
        logger.error("a late KV write for %s overwrote blocks %s after their release; ending the requests "
                     "holding them, for the router to retry: %s", event.req, list(event.blocks)[:16], holders)
        ended = []
        for request_id in holders:
            if request_id not in self.corrupted:
                ended += self.abort(request_id)
                self.corrupted.append(request_id)
        return ended
