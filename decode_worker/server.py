"""A decode worker process: takes requests over ZMQ, hands long prompts to a prefill
worker (decode-first push), decodes with continuous batching, and sends every
request's new tokens after each step.

Remote prefills go to the prefill worker with the fewest of this worker's requests in
flight; when every one has router.prefill_max_outstanding (the pool is saturated),
the prompt is prefilled here instead.

Failures (cluster/worker_loop.py): a request refused as bad input gets `rejected` with
status 400. A step that fails (RequestsFailed) ends the requests it names with
`rejected`, status 500, or 400 when their own parameters made it fail (a stream that
had begun ends with an error event), and the worker goes on. Anything worse ends every request with `rejected`, status 500, and
the process, for a restart.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import zmq

from cluster.config import ClusterConfig
from cluster.control import ControlChannel
from cluster.worker_loop import WorkerLoop, engine_and_transport, run_worker, stall_grace_s
from decode_worker.remote_kv import DecodeWorkerCore
from engine.engine_core import RequestsFailed
from engine.request import Request
from engine.sampling_params import SamplingParams
from router.protocol import encode

logger = logging.getLogger(__name__)

# Prefix-cache events kept for the router between two of its stats requests, per KV
# block; beyond that they are dropped and the router told to start its index over.
KV_EVENTS_PER_BLOCK = 4


@dataclass
class _Timing:
    """When a request passed each point on this worker (time.monotonic())."""

    arrived: float
    first_token: float | None = None
    remote_compute_s: float | None = None  # as the prefill worker reported it
    remote_transfer_s: float | None = None


class DecodeWorker(WorkerLoop):
    def __init__(self, name: str, core: DecodeWorkerCore, prefill_max_outstanding: int = 16,
                 host: str = "127.0.0.1", stall_timeout_s: float | None = None, stall_grace_s: float = 2.0) -> None:
        core.engine.kv.pool.events = []  # collected for the router (stats replies); before any socket exists
        super().__init__(name, host, stall_timeout_s, stall_grace_s)
        self.core = core
        self.prefill_max_outstanding = prefill_max_outstanding
        self.clients: dict[str, tuple[zmq.Socket, bytes]] = {}  # request id -> who asked
        self.sent: dict[str, int] = {}  # request id -> output tokens already sent
        self.prefill_of: dict[str, str] = {}  # request id -> prefill worker doing it
        self.timing: dict[str, _Timing] = {}
        self.prefill_workers: list[str] = []
        self.prefill_addresses: dict[str, str] = {}
        self.transfer = dict(saturated=0, kv_bytes_received=0, kv_transfer_seconds=0.0,
                             kv_transfer_failures=0)
        self._kv_events_lost = False

    def set_peers(self, msg: dict) -> list[str]:
        """The prefill workers to use (name -> ZMQ address). One that left the list, or
        came back at a new address (restarted), is gone: its prompts still waiting for
        KV are prefilled here at once (a dead sender can write nothing more). The
        senders make the KV handshakes, so none is cold here."""
        addresses: dict[str, str] = msg["prefill"]
        for name in [n for n in self.prefill_addresses if addresses.get(n) != self.prefill_addresses[n]]:
            logger.warning("%s: prefill worker %s is gone; its prompts here are prefilled locally", self.name, name)
            self.disconnect(name)
            del self.prefill_addresses[name]
            self.prefill_of = {r: p for r, p in self.prefill_of.items() if p != name}
            self.core.transport.peer_gone(name)  # Released -> local fallback (remote_kv.py)
        for name, address in addresses.items():
            if name not in self.prefill_addresses:
                self.connect(name, address)
                self.prefill_addresses[name] = address
        self.prefill_workers = sorted(addresses)
        return []

    def _pick_prefill_worker(self) -> str | None:
        """The prefill worker with the fewest of our prompts in flight, or None when
        every one has prefill_max_outstanding (saturated: prefill here)."""
        if not self.prefill_workers:
            return None
        # In flight = still waiting for KV; the others are done with their prefill
        # worker (KV arrived, or fell back after a failure or a dead worker).
        self.prefill_of = {r: p for r, p in self.prefill_of.items() if r in self.core.waiting_for_kv}
        load = Counter(self.prefill_of.values())
        name = min(self.prefill_workers, key=lambda n: (load[n], n))
        if load[name] >= self.prefill_max_outstanding:
            self.transfer["saturated"] += 1
            return None
        return name

    def busy(self) -> bool:
        return self.core.engine.has_unfinished()

    def handle(self, sender: bytes, msg: dict, sock: zmq.Socket) -> None:
        kind = msg["kind"]
        if kind == "generate":
            self._generate(sender, msg, sock)
        elif kind == "abort":
            self._abort(msg["id"])
        elif kind == "stats":
            events, reset = self._kv_events()
            self.send(sock, sender, encode("stats_reply", seq=msg["seq"], stats=self.stats(), kv_events=events,
                                           kv_reset=reset))
        elif kind == "prefill_done":
            self._prefill_done(sender.decode(), msg)

    def _prefill_done(self, prefill: str, msg: dict) -> None:
        request_id = msg["id"]
        self.transfer["kv_bytes_received"] += msg["bytes"]
        self.transfer["kv_transfer_seconds"] += msg["transfer_s"]
        if msg["error"]:
            if request_id in self.core.waiting_for_kv:  # else not (or no longer) ours, e.g. from before a restart
                logger.warning("prefill of %s failed on %s: %s", request_id, prefill, msg["error"])
                self.transfer["kv_transfer_failures"] += 1
                self.core.prefill_failed(request_id)
        elif request_id in self.timing:
            self.timing[request_id].remote_compute_s = msg["compute_s"]
            self.timing[request_id].remote_transfer_s = msg["transfer_s"]

    def _generate(self, sender: bytes, msg: dict, sock: zmq.Socket) -> None:
        request_id = msg["id"]
        prefill = self._pick_prefill_worker() if msg["remote"] else None
        try:
            params = SamplingParams(**msg["params"])
            rp = self.core.add_request(request_id, msg["prompt"], params, prefill is not None, msg["priority"],
                                       sender=prefill)
        except (TypeError, ValueError) as exc:  # bad input: say so, keep serving
            self.send(sock, sender, encode("rejected", id=request_id, error=str(exc), status=400))
            return
        self.clients[request_id] = (sock, sender)
        self.sent[request_id] = 0
        self.timing[request_id] = _Timing(time.monotonic())
        if rp is not None:
            self.prefill_of[request_id] = prefill
            self.dealers[prefill].send(encode(
                "prefill", id=request_id, prompt=rp.prompt_token_ids, peer=rp.peer, blocks=rp.block_ids,
                first=rp.first_block, epoch=rp.epoch, deadline=rp.deadline, session=rp.session))

    def _abort(self, request_id: str) -> None:
        sock = self.dealers.get(self.prefill_of.pop(request_id, ""))
        if sock is not None:  # its prefill worker may be gone
            sock.send(encode("abort", id=request_id))
        self.core.abort(request_id)
        self._forget(request_id)

    def _fail(self, request_id: str, error: str, status: int = 500) -> None:
        """End a request with an error its client is told: a rejection with `status`
        (500: it failed here; 400: its own parameters made it fail)."""
        client = self.clients.get(request_id)
        self._abort(request_id)
        if client is not None:
            self.send(*client, encode("rejected", id=request_id, error=error, status=status))

    def _forget(self, request_id: str) -> None:
        self.clients.pop(request_id, None)
        self.sent.pop(request_id, None)
        self.timing.pop(request_id, None)
        self.core.kv_ready_at.pop(request_id, None)

    def pending(self) -> bool:
        """Work a step can advance (the stall watchdog's question): requests running,
        or queued. Not requests waiting for pushed KV (their deadline bounds that), nor
        a queue that, with nothing running, waits for blocks while KV reservations are
        open: those blocks come back by the reservation's deadline plus the transport's
        cancel grace at the latest."""
        scheduler = self.core.engine.scheduler
        if scheduler.running:
            return True
        return bool(scheduler.num_waiting) and not self.core.transport.holds_reservations()

    def fail_all(self, error: str, stalled: bool) -> None:
        """The worker gives up. Its prefill workers stop writing into its blocks; its
        clients are told each request failed (status 500), unless it stalled: then the
        router fails them over to another decode worker."""
        for request_id, prefill in self.prefill_of.items():
            sock = self.dealers.get(prefill)
            if sock is not None:
                self.send_now(sock, prefill.encode(), encode("abort", id=request_id))
        if stalled:
            return
        for request_id, (sock, sender) in self.clients.items():
            self.send_now(sock, sender, encode("rejected", id=request_id, error=error, status=500))

    def step(self) -> None:
        try:
            out = self.core.step()
        except RequestsFailed as exc:
            # The step is void and names its requests (e.g. a penalty that overflowed
            # their logits, or a model step that raised): they end with the error, and
            # every other request computes the step again next time.
            logger.warning("%s: %s", self.name, exc)
            error = _step_error(exc)
            for request_id in exc.request_ids:
                self._fail(request_id, error, 400 if exc.at_fault else 500)
            self._fail_corrupted()
            self.step_failed(exc)  # several in a row: the device is broken (fatal)
            return
        if out.num_tokens or out.finished:
            self.progressed()
            self.step_succeeded()
        self._fail_corrupted()
        self._bound_kv_events()
        finished = {r.request_id for r in out.finished}
        now = time.monotonic()
        for request in {r.request_id: r for r in out.advanced + out.finished}.values():
            rid = request.request_id
            client = self.clients.get(rid)
            if client is None:
                continue
            sent = self.sent[rid]
            new = request.output_token_ids[sent:]
            self.sent[rid] += len(new)
            if new and self.timing[rid].first_token is None:
                self.timing[rid].first_token = now
            logprobs = []
            if request.sampling_params.logprobs is not None:
                logprobs = [[lp.logprob, [[t, v] for t, v in lp.top]]
                            for lp in request.output_logprobs[sent:sent + len(new)]]
            done = rid in finished
            self.send(*client, encode("tokens", id=rid, tokens=new, finished=done,
                                      reason=request.status.value if done else "",
                                      cached=request.num_cached_tokens, logprobs=logprobs,
                                      phases=self._phases(request, now) if done else {}))
            if done:
                self._forget(rid)

    def _fail_corrupted(self) -> None:
        """Requests the core aborted because a late KV write overwrote their blocks
        (decode_worker/remote_kv.py): their clients are told."""
        corrupted, self.core.corrupted = self.core.corrupted, []
        for request_id in corrupted:
            self._fail(request_id, "its KV cache blocks were overwritten by a late KV write, so its "
                                   "output could not be trusted")

    def _phases(self, request: Request, now: float) -> dict[str, float]:
        """Seconds per phase, router/metrics.py defines them. A request whose remote
        prefill failed over counts as prefilled here."""
        t = self.timing[request.request_id]
        first_token = t.first_token if t.first_token is not None else now
        scheduled = request.first_scheduled_time or now
        kv_ready = self.core.kv_ready_at.get(request.request_id)
        phases = {"decode": now - first_token}
        if kv_ready is not None and t.remote_compute_s is not None:
            phases.update(queue=max(0.0, scheduled - kv_ready), prefill=t.remote_compute_s,
                          transfer=max(0.0, kv_ready - t.arrived - t.remote_compute_s))
        else:
            phases.update(queue=max(0.0, scheduled - t.arrived), prefill=max(0.0, first_token - scheduled))
        return phases

    def _kv_events(self) -> tuple[list, bool]:
        """The prefix-cache events since the last stats reply, for the router's kv_aware
        index; reset=True when too many piled up (nobody asked) and were dropped."""
        pool = self.core.engine.kv.pool
        events, reset = pool.events or [], self._kv_events_lost
        pool.events, self._kv_events_lost = [], False
        return events, reset

    def _bound_kv_events(self) -> None:
        pool = self.core.engine.kv.pool
        if len(pool.events) > KV_EVENTS_PER_BLOCK * pool.num_blocks:
            pool.events.clear()
            self._kv_events_lost = True

    def stats(self) -> dict:
        kv = self.core.engine.kv
        return {"name": self.name, "num_blocks": kv.pool.num_blocks, "free_blocks": kv.num_free_blocks,
                "running": len(self.core.engine.scheduler.running),
                "waiting": self.core.engine.scheduler.num_waiting,
                "waiting_for_kv": len(self.core.waiting_for_kv), **self.core.stats, **self.transfer,
                "late_writes_dropped": self.core.transport.stats["late_writes_dropped"], **self.health()}


def _step_error(exc: RequestsFailed) -> str:
    """What a request's client is told when the step it was in failed."""
    if exc.at_fault:
        return ("nothing could be sampled for this request: its logits were NaN, +inf, or -inf for every "
                "token (after its penalties and min_tokens masking)")
    return f"the engine step this request was in failed: {exc}"


def serve(config: ClusterConfig, index: int, control: ControlChannel, host: str = "127.0.0.1") -> None:
    """Worker entry point: start (sockets on `host`), report ready on `control`, get
    peers, run (cluster/control.py)."""
    name, engine, transport = engine_and_transport(config, "decode", index, host)
    worker = DecodeWorker(name, DecodeWorkerCore(engine, transport, config.prefill_deadline_s),
                          config.router.prefill_max_outstanding, host, config.router.stall_timeout_s,
                          stall_grace_s(config))
    run_worker(worker, control, transport)
