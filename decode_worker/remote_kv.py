"""The decode worker's side of a remote prefill: reserve, receive, or fall back.

add_request(..., remote=True) reserves blocks for the prompt and returns the
RemotePrefill to send to a prefill worker. step() polls the transport: a Completed
reservation makes the request runnable (its first step computes the last prompt token
and samples); an Expired one, or prefill_failed(), falls back to prefilling locally,
but only once the transport has Released the blocks (a one-sided write can no longer
land in them). An abort of a request still waiting for its KV waits for the same.

Should a one-sided write land after all in blocks already released (Overwritten: a
data plane slower than the transport's bounds), their contents are unknown: step()
tells the engine (EngineCore.invalidate_blocks: they leave the prefix cache), aborts
every request holding one (reported among the step's finished requests, status abort),
and lists those in `corrupted`, which the caller drains to have the router retry each
(decode_worker/server.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from engine.engine_core import EngineCore, StepOutput
from engine.kv_cache.manager import cdiv
from engine.request import Request
from engine.sampling_params import SamplingParams
from kv_transfer import Completed, Expired, KVTransport, Overwritten, Released
from protocol import RemotePrefill
from workers.step_metrics import StepMetrics

logger = logging.getLogger(__name__)


@dataclass
class _RemoteKV:
    """A request whose prompt KV was (or is being) pushed here."""

    waiting: bool = True  # for its KV: neither arrived nor Released
    on_release: str | None = None  # what its Released does: "fallback" (the default) or "abort"
    ready_at: float | None = None  # time.monotonic() its pushed KV completed


class DecodeWorkerCore:
    """Drives one engine (role: decode) and one transport. Call step() in a loop."""

    def __init__(self, engine: EngineCore, transport: KVTransport, deadline_s: float = 30.0) -> None:
        self.engine = engine
        self.transport = transport
        self.deadline_s = deadline_s
        self.block_size = engine.config.block_size
        self._remote: dict[str, _RemoteKV] = {}  # forget() drops a request's
        # Unique per reservation, so a late write for an earlier one under a reused
        # request id is never taken for the new one's.
        self._epochs = itertools.count(1)
        self.stats = dict(remote=0, local=0, fallbacks=0)
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

    def forget(self, request_id: str) -> None:
        """The request has ended and been reported: drop what is kept of it (not while
        it waits for its KV: its blocks come back through the transport)."""
        if not self.is_waiting_for_kv(request_id):
            self._remote.pop(request_id, None)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    remote: bool, priority: int = 0, sender: str | None = None,
                    resumed: int = 0) -> RemotePrefill | None:
        """Queue a request. With remote=True and blocks to spare, returns what the prefill
        worker must do; None means it prefills here. `sender`: the prefill worker's
        agent name, if known, so that its death releases the blocks at once
        (KVTransport.peer_gone). `resumed`: EngineCore.add_request's."""
        if remote and len(prompt_token_ids) >= 2:
            request = self.engine.add_remote_prefill_request(request_id, prompt_token_ids, params, priority,
                                                             resumed)
            if request is not None:
                return self._expect(request_id, prompt_token_ids, request.num_cached_tokens, sender)
        self.engine.add_request(request_id, prompt_token_ids, params, priority, resumed)
        self.stats["local"] += 1
        return None

    def _expect(self, request_id: str, prompt: list[int], num_cached: int,
                sender: str | None) -> RemotePrefill | None:
        blocks = self.engine.block_ids(request_id)
        first, end = num_cached // self.block_size, cdiv(len(prompt) - 1, self.block_size)
        if first >= end:  # the local prefix cache already holds it all
            self.engine.remote_kv_arrived(request_id)
            self.stats["local"] += 1
            return None
        epoch = next(self._epochs)
        deadline = time.time() + self.deadline_s
        self.transport.expect(request_id, epoch, blocks[first:end], deadline, sender)
        self._remote[request_id] = _RemoteKV()
        self.stats["remote"] += 1
        return RemotePrefill(request_id=request_id, prompt_token_ids=list(prompt), peer=self.transport.agent_name,
                             block_ids=blocks, first_block=first, epoch=epoch, deadline=deadline,
                             session=self.transport.session)

    def prefill_failed(self, request_id: str) -> None:
        """The prefill worker reported failure (or died): prefill locally instead."""
        kv = self._remote.get(request_id)
        if kv is not None and kv.waiting:
            kv.on_release = kv.on_release or "fallback"
            self.transport.abort(request_id)

    def abort(self, request_id: str) -> list[Request]:
        """End a request; returns it if it ended now (one waiting for its KV ends once
        its blocks are Released)."""
        kv = self._remote.get(request_id)
        if kv is not None and kv.waiting:
            kv.on_release = "abort"
            self.transport.abort(request_id)
            return []
        return self.engine.abort([request_id])

    def step(self) -> StepOutput:
        ended = []  # aborted here for an overwritten block: reported as finished (aborted)
        for event in self.transport.poll():
            if isinstance(event, Overwritten):
                ended += self._overwritten(event)
                continue
            kv = self._remote.get(event.req)
            if kv is None or not kv.waiting:
                continue
            if isinstance(event, Completed):
                kv.waiting, kv.ready_at = False, time.monotonic()
                self.engine.remote_kv_arrived(event.req)
            elif isinstance(event, Expired):
                kv.on_release = kv.on_release or "fallback"
            elif isinstance(event, Released):
                kv.waiting = False
                if kv.on_release == "abort":
                    del self._remote[event.req]  # ended: nobody reports it
                    self.engine.abort([event.req])
                else:
                    self.stats["fallbacks"] += 1
                    self.engine.remote_kv_failed(event.req)
        out = self.steps.step(self.engine) if self.engine.has_unfinished() else StepOutput()
        out.finished += ended
        return out

    def _overwritten(self, event: Overwritten) -> list[Request]:
        """A late write of released reservation (event.req, event.epoch) landed in
        event.blocks: whatever they hold now is unknown."""
        # Its own request too, if it prefills locally in them now: the write's last,
        # partial block carries whatever P's block held past the prompt, over the slots
        # of the tokens generated here since.
        holders = self.engine.invalidate_blocks(list(event.blocks))
        logger.error("a late KV write for %s overwrote blocks %s after their release; ending the requests "
                     "holding them, for the router to retry: %s", event.req, list(event.blocks)[:16], holders)
        ended = []
        for request_id in holders:
            if request_id not in self.corrupted:
                ended += self.abort(request_id)
                self.corrupted.append(request_id)
        return ended
