"""The prefill worker's side of a remote prefill (protocol.RemotePrefill).

Decode-first push (docs/architecture.md): the decode worker D reserves blocks for the
prompt and sends a RemotePrefill; the prefill worker P computes the KV of every prompt token but
the last (D computes that one, and samples), writing each block to D as soon as it is
full, and the last, partial one at the end. P never samples and frees its blocks
once every write is acknowledged (or failed).

What a write carries (transport_options.stream): `off`, every block once the prompt is
computed; `chunk`, each step's newly full blocks after that step; `layer`, each step's
newly full blocks a group of `stream_layers` layers at a time, from inside the step, as
soon as the forward has written those layers (EngineCore.set_layer_hook), so that the
transfer of a step's first layers overlaps the compute of its last. D counts a block in
only once every layer of it has come (kv_transfer/receiver.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from engine.engine_core import EngineCore, StepOutput
from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.manager import cdiv
from engine.kv_cache.window import layers_reading
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
    stream: str = "chunk"  # off: every block at the end; chunk: after each step; layer: within it
    layers_sent: int = 0  # layer mode: layers [0, layers_sent) of this step's blocks are written
    outstanding: set[int] = field(default_factory=set)  # xfer ids in flight
    failed: str | None = None
    bytes_written: int = 0


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
        config = transport.config
        self.num_layers = engine.model_config.num_layers
        self.layer_group = min(config.stream_layers, self.num_layers)
        if config.stream == "layer":
            engine.set_layer_hook(self._layer_written)

    def submit(self, rp: RemotePrefill) -> None:
        """Start computing rp's prompt. Refused (stats["refused"], and ValueError naming
        why) when its blocks do not fit, its decode worker is not the peer that reserved
        them, or it arrived after its deadline."""
        end = cdiv(len(rp.prompt_token_ids) - 1, self.block_size)
        refusal = self._refusal(rp, end)
        if refusal is not None:
            self.stats["refused"] += 1
            raise ValueError(f"{rp.request_id}: {refusal}")
        # Its engine's queue orders jobs as D's orders requests: (priority, queue_tag, arrival).
        # An adapter it holds no read of is read now (a few ms): cheaper than D
        # prefilling the prompt itself. One it cannot read refuses the job.
        lora = rp.lora.request() if rp.lora is not None else None
        try:
            self.engine.add_prefill_request(rp.request_id, rp.prompt_token_ids[:-1], priority=rp.priority,
                                            queue_tag=rp.queue_tag, lora_request=lora)
        except ValueError:
            self.stats["refused"] += 1
            raise
        config = self.transport.config
        stream = config.stream if len(rp.prompt_token_ids) >= config.stream_min_tokens else "off"
        self.jobs[rp.request_id] = _Job(rp, rp.first_block, end, stream=stream)

    def _refusal(self, rp: RemotePrefill, end: int) -> str | None:
        if not (0 <= rp.first_block < end <= len(rp.block_ids)):
            return f"blocks [{rp.first_block}, {end}) to write do not fit the {len(rp.block_ids)} destination blocks"
        if rp.layer_first_blocks and (len(rp.layer_first_blocks) != self.num_layers
                                      or min(rp.layer_first_blocks) != rp.first_block):
            return (f"layer_first_blocks {rp.layer_first_blocks[:8]} must give each of the model's {self.num_layers} "
                    f"layers a first block, the first of them {rp.first_block} (first_block)")
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
        for job in self.jobs.values():  # a step that failed part-way left its layers to write again
            job.layers_sent = 0
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
        # (Layer mode wrote each step's blocks from inside it: what is left here is what
        # no step computed, a prompt P's prefix cache held whole.)
        if prefilled:
            ready = job.end_block
        elif job.stream == "chunk":
            ready = min(computed // self.block_size, job.end_block)
        else:
            return
        if ready > job.next_block and self._write(request_id, job, ready, None):
            self.stats["blocks_written"] += ready - job.next_block
            job.next_block = ready

    def _layer_written(self, layer: int, computed: Mapping[str, int]) -> None:
        """The engine's layer hook: layer `layer` of the step's tokens is in the cache.
        Each streaming job writes the blocks the step completes, every layer_group
        layers, and counts them written after the last layer."""
        last = layer == self.num_layers - 1
        for request_id, tokens in computed.items():
            job = self.jobs.get(request_id)
            if job is None or job.failed is not None or job.stream != "layer":
                continue
            done = tokens >= len(job.rp.prompt_token_ids) - 1
            ready = job.end_block if done else min(tokens // self.block_size, job.end_block)
            if ready <= job.next_block or not (last or layer + 1 - job.layers_sent >= self.layer_group):
                continue
            cache = self.transport.registered_cache
            if cache.is_cuda and not self.transport.stream_ordered:  # queued, not run: post it once run
                torch.cuda.current_stream(cache.device).synchronize()
            if not self._write(request_id, job, ready, (job.layers_sent, layer + 1)):
                continue
            job.layers_sent = layer + 1
            if last:
                self.stats["blocks_written"] += ready - job.next_block
                job.next_block, job.layers_sent = ready, 0

    def _write(self, request_id: str, job: _Job, ready: int, layers: tuple[int, int] | None) -> bool:
        """Write the job's blocks [next_block, ready) (`layers` of them, None: every
        layer; of a block before some layer's window at D, only the layers that read
        it), holding them until the write ends. False: its decode worker is gone."""
        rp = job.rp
        if self.transport.peer_session(rp.peer) != rp.session:  # gone, or restarted: not its blocks
            self.fail_jobs_for(rp.peer)
            return False
        block_bytes = self.transport.registered_compat.block_bytes
        for start, end, (l0, l1) in layers_reading(rp.layer_first_blocks, job.next_block, ready,
                                                   layers or (0, self.num_layers)):
            held = self.engine.hold_blocks(request_id, start, end)
            try:
                xfer = self.transport.write(rp.peer, request_id, rp.epoch, [b.block_id for b in held],
                                            rp.block_ids[start:end], rp.deadline, (l0, l1))
            except BaseException:
                self.engine.release_blocks(held)
                raise
            self._held[xfer] = held
            job.outstanding.add(xfer)
            job.bytes_written += (end - start) * block_bytes * (l1 - l0) // self.num_layers
        return True

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
                                     transfer_s=now - computed, bytes_written=job.bytes_written))
        return ended
