"""The prefill worker's side of a remote prefill (protocol.RemotePrefill).

Decode-first push (docs/architecture.md): the decode worker D reserves blocks for the
prompt and sends a RemotePrefill; the prefill worker P computes the KV of every prompt token but
the last (D computes that one, and samples), writing each block to D as soon as it is
full, and the last, partial one at the end. P never samples and frees its blocks
once every write is acknowledged (or failed).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.engine_core import EngineCore, StepOutput
from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.manager import cdiv
from engine.request import RequestStatus
from kv_transfer import KVTransport, WriteDone, WriteFailed
from protocol import PrefillDone, RemotePrefill
from workers.step_metrics import StepMetrics

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    rp: RemotePrefill
    next_block: int  # first block index not yet written
    end_block: int  # one past the last block index to write
    submitted: float = field(default_factory=time.monotonic)
    computed: float | None = None  # when the engine reported the prompt's KV complete
    stream: bool = True  # write blocks as they are computed, not all at the end
    outstanding: set[int] = field(default_factory=set)  # xfer ids in flight
    failed: str | None = None


class PrefillWorkerCore:
    """Drives one engine (role: prefill) and one transport. Call step() in a loop."""

    def __init__(self, engine: EngineCore, transport: KVTransport) -> None:
        self.engine = engine
        self.transport = transport
        self.block_size = engine.config.block_size
        self.jobs: dict[str, _Job] = {}
        # Source blocks of each write in flight, held until it is done or failed (only
        # then has the data plane stopped reading them): the engine may preempt or
        # abort their request meanwhile, and must not hand them to another one.
        self._held: dict[int, list[KVBlock]] = {}
        self.stats = dict(prefills=0, blocks_written=0, failed=0, refused=0, tokens_computed=0)
        self.steps = StepMetrics()  # its engine steps' time and batch (stats replies)

    def submit(self, rp: RemotePrefill) -> None:
        """Start computing rp's prompt. Refused (stats["refused"], and ValueError naming
        why) when its blocks do not fit, its decode worker is not the peer that reserved
        them, or it arrived after its deadline."""
        end = cdiv(len(rp.prompt_token_ids) - 1, self.block_size)
        refusal = self._refusal(rp, end)
        if refusal is not None:
            self.stats["refused"] += 1
            raise ValueError(f"{rp.request_id}: {refusal}")
        self.engine.add_prefill_request(rp.request_id, rp.prompt_token_ids[:-1])
        config = self.transport.config
        stream = config.stream == "chunk" and len(rp.prompt_token_ids) >= config.stream_min_tokens
        self.jobs[rp.request_id] = _Job(rp, rp.first_block, end, stream=stream)

    def _refusal(self, rp: RemotePrefill, end: int) -> str | None:
        if not (0 <= rp.first_block < end <= len(rp.block_ids)):
            return f"blocks [{rp.first_block}, {end}) to write do not fit the {len(rp.block_ids)} destination blocks"
        if self.transport.peer_session(rp.peer) != rp.session:
            return (f"decode worker {rp.peer!r} is not a peer in the session that reserved these blocks "
                    "(it restarted, or is gone)")
        if time.time() > rp.deadline:  # held up on the way (a partition that healed): D has prefilled it
            return "arrived after its reservation's deadline; not computed"
        return None

    def fail_jobs_for(self, peer: str) -> None:
        """Decode worker `peer` died (or restarted: its blocks are not the ones reserved):
        every job for it writes no more and ends at the next step."""
        for request_id, job in self.jobs.items():
            if job.rp.peer == peer and job.failed is None and self.transport.peer_session(peer) != job.rp.session:
                job.failed = f"decode worker {peer!r} is gone or restarted"
                self.transport.cancel(request_id)

    def abort(self, request_id: str) -> None:
        """D gave up on it: write no more; it ends (reported by step) once in-flight
        writes have settled."""
        job = self.jobs.get(request_id)
        if job is not None and job.failed is None:
            job.failed = "aborted by the decode worker"
            self.transport.cancel(request_id)

    def fail(self, request_id: str, reason: str) -> None:
        """Its step failed: it writes no more and leaves the engine now (no later step
        computes it again; blocks with writes in flight stay held until those settle).
        step() reports it, with `reason`, once its writes have settled."""
        job = self.jobs.get(request_id)
        if job is None:
            return
        if job.failed is None:
            job.failed = reason
            self.transport.cancel(request_id)
        self.engine.abort([request_id])

    def step(self) -> list[PrefillDone]:
        """One engine step plus transfer progress. Returns every job that ended: its KV
        written (error None), or failed."""
        out = self.steps.step(self.engine) if self.engine.has_unfinished() else StepOutput()
        self.stats["tokens_computed"] += out.num_tokens
        prefilled = {r.request_id for r in out.finished if r.status == RequestStatus.PREFILLED}
        now = time.monotonic()
        for request_id in prefilled & self.jobs.keys():
            self.jobs[request_id].computed = now
        for request_id, job in self.jobs.items():
            if job.failed is None:
                self._write_ready_blocks(request_id, job, request_id in prefilled)
        for event in self.transport.poll():
            if not isinstance(event, (WriteDone, WriteFailed)):
                continue
            held = self._held.pop(event.xfer, None)
            if held is not None:
                self.engine.release_blocks(held)
            written = self.jobs.get(event.req)
            if written is None:
                continue
            written.outstanding.discard(event.xfer)
            if isinstance(event, WriteFailed) and written.failed is None:
                written.failed = event.reason
                self.transport.cancel(event.req)
        return self._finish_jobs()

    def _write_ready_blocks(self, request_id: str, job: _Job, prefilled: bool) -> None:
        computed = self.engine.computed_tokens(request_id)
        if computed is None:
            return
        # Full blocks are final as soon as computed; the partial last one once prefilled.
        if prefilled:
            ready = job.end_block
        elif job.stream:
            ready = min(computed // self.block_size, job.end_block)
        else:
            return
        if ready <= job.next_block:
            return
        rp = job.rp
        if self.transport.peer_session(rp.peer) != rp.session:  # gone, or restarted: not its blocks
            self.fail_jobs_for(rp.peer)
            return
        held = self.engine.hold_blocks(request_id, job.next_block, ready)
        try:
            xfer = self.transport.write(rp.peer, request_id, rp.epoch, [b.block_id for b in held],
                                        rp.block_ids[job.next_block:ready], rp.deadline)
        except BaseException:
            self.engine.release_blocks(held)
            raise
        self._held[xfer] = held
        job.outstanding.add(xfer)
        self.stats["blocks_written"] += ready - job.next_block
        job.next_block = ready

    def _finish_jobs(self) -> list[PrefillDone]:
        ended, now = [], time.monotonic()
        for request_id, job in list(self.jobs.items()):
            prefilled = self.engine.is_prefilled(request_id)
            written = job.next_block == job.end_block and prefilled
            if job.outstanding or not (written or job.failed):
                continue
            if prefilled:
                self.engine.release_prefilled(request_id)
            else:
                self.engine.abort([request_id])
            del self.jobs[request_id]
            self.stats["prefills" if job.failed is None else "failed"] += 1
            computed = job.computed if job.computed is not None else now
            ended.append(PrefillDone(request_id=request_id, error=job.failed, compute_s=computed - job.submitted,
                                     transfer_s=now - computed, bytes_written=(job.next_block - job.rp.first_block)
                                     * self.transport.registered_compat.block_bytes))
        return ended
