"""A decode worker process: takes requests over ZMQ, hands long prompts to a prefill
worker (decode-first push), decodes with continuous batching, and sends every
request's new tokens after each step.

Remote prefills go to the prefill worker with the fewest of this worker's requests in
flight; when every one has router.prefill_max_outstanding (the pool is saturated),
the prompt is prefilled here instead.

Failures (workers/loop.py): a request refused as bad input gets `rejected` with
status 400; one breaking a rule the router owns (decode_worker/guards.py), status 500. A step that fails (RequestsFailed) ends the requests it names with
`rejected`, status 500, or 400 when their own parameters made it fail (a stream that
had begun ends with an error event), and the worker goes on. Anything worse ends every request with `rejected`, status 500, and
the process, for a restart.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass

import zmq

from decode_worker.guards import RouterBug, check_router_rules
from decode_worker.remote_kv import DecodeWorkerCore
from engine.errors import RequestsFailed
from engine.request import Request
from engine.sampling import TokenLogprobs
from protocol import (
    Abort,
    Generate,
    Message,
    MessageError,
    Peers,
    PrefillDone,
    Rejected,
    SpecDecodeStats,
    Stats,
    StatsReply,
    Tokens,
    WorkerStats,
    child_request_id,
    encode,
    from_wire,
)
from protocol.worker import PromptTokenLogprobs
from security import DeploymentSecret
from workers.config import WorkerConfig
from workers.control import ControlChannel
from workers.loop import WorkerLoop, run_worker
from workers.start import engine_and_transport

logger = logging.getLogger(__name__)

# Prefix-cache events kept for the router between two of its stats requests, per KV
# block; beyond that they are dropped and the router told to start its index over.
KV_EVENTS_PER_BLOCK = 4


@dataclass
class _Client:
    """A request this worker serves: who asked, what it was sent, and when it passed
    each point here (time.monotonic())."""

    sock: zmq.Socket  # the socket it came in on, and the asker's routing id
    sender: bytes
    arrived: float
    sent: int = 0  # output tokens already sent
    prefill: str | None = None  # the prefill worker asked to compute its prompt
    first_token: float | None = None
    remote_compute_s: float | None = None  # as the prefill worker reported it
    remote_transfer_s: float | None = None
    # Parallel sampling (n > 1): a sequence's entry names its group; the group's own
    # entry (its prompt's remote prefill; never reported to the router) lists the
    # sequences not yet ended.
    group: str | None = None
    members: set[str] | None = None


class DecodeWorker(WorkerLoop):
    def __init__(self, name: str, core: DecodeWorkerCore, prefill_max_outstanding: int = 16,
                 host: str = "127.0.0.1", stall_timeout_s: float | None = None, stall_grace_s: float = 2.0,
                 secret: DeploymentSecret | None = None) -> None:
        # Collected for the router (stats replies); before any socket exists.
        core.engine.collect_kv_events(KV_EVENTS_PER_BLOCK)
        super().__init__(name, host, stall_timeout_s, stall_grace_s, secret)
        self.core = core
        self.prefill_max_outstanding = prefill_max_outstanding
        self.requests: dict[str, _Client] = {}
        self.prefill_workers: list[str] = []  # those that take new prompts (not draining)
        self.prefill_addresses: dict[str, str] = {}
        self.transfer = dict(saturated=0, kv_bytes_received=0, kv_transfer_seconds=0.0,
                             kv_transfer_failures=0)

    def set_peers(self, msg: Peers) -> list[str]:
        """The prefill workers to use (name -> ZMQ address). One that left the list, or
        came back at a new address (restarted), is gone: its prompts still waiting for
        KV are prefilled here at once (a dead sender can write nothing more). A
        draining one gets no new prompt, and its prompts in flight go on. The senders
        make the KV handshakes, so none is cold here."""
        addresses = msg.prefill
        for name in [n for n in self.prefill_addresses if addresses.get(n) != self.prefill_addresses[n]]:
            logger.warning("%s: prefill worker %s is gone; its prompts here are prefilled locally", self.name, name)
            self.disconnect(name)
            del self.prefill_addresses[name]
            for client in self.requests.values():
                if client.prefill == name:
                    client.prefill = None
            self.core.transport.peer_gone(name)  # Expired -> local fallback (remote_kv.py)
        for name, address in addresses.items():
            if name not in self.prefill_addresses:
                self.connect(name, address)
                self.prefill_addresses[name] = address
        self.prefill_workers = sorted(set(addresses) - set(msg.draining))
        return []

    def _pick_prefill_worker(self) -> str | None:
        """The prefill worker with the fewest of our prompts in flight, or None when
        every one has prefill_max_outstanding (saturated: prefill here)."""
        if not self.prefill_workers:
            return None
        # In flight = still waiting for KV; the others are done with their prefill
        # worker (KV arrived, or fell back after a failure or a dead worker).
        for request_id, client in self.requests.items():
            if client.prefill is not None and not self.core.is_waiting_for_kv(request_id):
                client.prefill = None
        load = Counter(c.prefill for c in self.requests.values() if c.prefill is not None)
        # One whose unconfirmed writes already hold too many of our blocks gets none.
        usable = [n for n in self.prefill_workers if self.core.accepts_prompts_from(n)]
        if not usable:
            self.core.stats["fenced_refusals"] += 1
            return None
        name = min(usable, key=lambda n: (load[n], n))
        if load[name] >= self.prefill_max_outstanding:
            self.transfer["saturated"] += 1
            return None
        return name

    def busy(self) -> bool:
        return self.core.engine.has_unfinished()

    def runnable(self) -> bool:
        # Not requests that only wait for their prompt's KV: they wait on a prefill
        # worker. The transport learns of a finished write at its next poll (in step()),
        # so that wait adds up to WAIT_POLL_MS to a remote prefill, against a prefill of
        # hundreds of milliseconds on a CPU.
        return self.core.engine.has_runnable()

    def handle(self, sender: bytes, msg: Message, sock: zmq.Socket) -> None:
        if isinstance(msg, Generate):
            self._generate(sender, msg, sock)
        elif isinstance(msg, Abort):
            self._abort(msg.request_id)
        elif isinstance(msg, Stats):
            events, reset = self.core.engine.take_kv_events()
            self.send(sock, sender, encode(StatsReply(seq=msg.seq, stats=self.stats(), kv_events=events,
                                                      kv_reset=reset)))
        elif isinstance(msg, PrefillDone):
            self._prefill_done(sender.decode(), msg)

    def refuse(self, sender: bytes, error: MessageError, sock: zmq.Socket) -> None:
        """A Generate that is not one (a field of the wrong type, an unknown sampling
        parameter) is rejected by name, as bad input: the router never sends one.
        (Sampling parameters out of range are rejected by _generate, the same way.)"""
        if error.kind == "generate" and error.request_id is not None:
            self.send(sock, sender, encode(Rejected(request_id=error.request_id, error=str(error), status=400)))

    def _prefill_done(self, prefill: str, msg: PrefillDone) -> None:
        request_id = msg.request_id
        if msg.error is None:  # a failed job's bytes (some never sent, or dropped here) are not KV received
            self.transfer["kv_bytes_received"] += msg.bytes_written
            self.transfer["kv_transfer_seconds"] += msg.transfer_s
        if msg.error is not None:
            if self.core.is_waiting_for_kv(request_id):  # else not (or no longer) ours, e.g. from before a restart
                logger.warning("prefill of %s failed on %s: %s", request_id, prefill, msg.error)
                self.transfer["kv_transfer_failures"] += 1
                self.core.prefill_failed(request_id)
            if msg.refused_epoch is not None:  # it wrote nothing: no cancel_ack needed from it
                self.core.transport.unwritten(request_id, msg.refused_epoch, prefill)
        elif request_id in self.requests:
            self.requests[request_id].remote_compute_s = msg.compute_s
            self.requests[request_id].remote_transfer_s = msg.transfer_s

    def _generate(self, sender: bytes, msg: Generate, sock: zmq.Socket) -> None:
        request_id = msg.request_id
        try:
            params = from_wire(msg.params)
            engine = self.core.engine
            check_router_rules(msg.prompt, params, msg.remote, engine.max_model_len, engine.model_config.vocab_size)
            prefill = self._pick_prefill_worker() if msg.remote else None
            rp = self.core.add_request(request_id, msg.prompt, params, prefill is not None,
                                       msg.priority, sender=prefill, resumed=msg.resumed, queue_tag=msg.queue_tag,
                                       lora=msg.lora)
        except (TypeError, ValueError, RouterBug) as exc:  # bad input: say so, keep serving
            bug = isinstance(exc, RouterBug)
            if bug:
                logger.error("refused request %s: %s (the router should never send it)", request_id, exc)
            n = getattr(msg.params, "n", 1)
            ids = [child_request_id(request_id, i) for i in range(n)] if type(n) is int and 1 < n <= 4096 \
                else [request_id]  # each sequence is told, under the id the router awaits
            for rid in ids:
                self.send(sock, sender, encode(Rejected(
                    request_id=rid, error=f"internal error (a router bug): {exc}" if bug else str(exc),
                    status=500 if bug else 400, param=None if bug else getattr(exc, "param", None))))
            return
        now = time.monotonic()
        self.requests[request_id] = client = _Client(sock, sender, now)
        if params.n > 1:
            client.members = {child_request_id(request_id, i) for i in range(params.n)}
            for rid in client.members:
                self.requests[rid] = _Client(sock, sender, now, group=request_id)
        if rp is not None:
            assert prefill is not None  # add_request plans a remote prefill only when given a worker
            client.prefill = prefill
            self.dealers[prefill].send(encode(rp))

    def _abort(self, request_id: str) -> None:
        client = self.requests.pop(request_id, None)
        sock = self.dealers.get(client.prefill) if client is not None and client.prefill is not None else None
        if sock is not None:  # its prefill worker may be gone
            sock.send(encode(Abort(request_id=request_id)))
        self.core.abort(request_id)
        self.core.forget(request_id)
        if client is not None and client.group is not None:
            self._ended_in_group(client.group, request_id)

    def _ended_in_group(self, group: str, request_id: str) -> None:
        """A sequence of `group` ended; with the last one, the group's prompt ends (its
        remote prefill is told to stop, if it still runs)."""
        entry = self.requests.get(group)
        if entry is not None and entry.members is not None:
            entry.members.discard(request_id)
            if not entry.members:
                self._abort(group)

    def _fail(self, request_id: str, error: str, status: int = 500, param: str | None = None,
              retry: bool = False) -> None:
        """End a request with an error its client is told: a rejection with `status`
        (500: it failed here; 400: its own parameters made it fail, `param` if one did);
        `retry`: the router resubmits it instead."""
        client = self.requests.get(request_id)
        if client is not None and client.members is not None:  # a group's prompt: its sequences fail
            for rid in sorted(client.members):
                self._fail(rid, error, status, param, retry)
            return
        self._abort(request_id)
        if client is not None:
            self.send(client.sock, client.sender,
                      encode(Rejected(request_id=request_id, error=error, status=status, param=param, retry=retry)))

    def pending(self) -> bool:
        """Work a step can advance (the stall watchdog's question): requests running,
        or queued. Not requests waiting for pushed KV (their deadline bounds that), or
        for their grammar to compile (engine.grammar_compile_timeout_s bounds that), nor
        a queue that, with nothing running, waits for blocks while KV reservations are
        open or fenced: those come back when their prefill worker confirms or exits,
        and whether it is dead is its own watchdog's and supervisor's question."""
        stats = self.core.engine.stats()
        if stats.running:
            return True
        return stats.waiting > stats.compiling and not self.core.transport.holds_reservations()

    def fail_all(self, error: str, fail_over: bool) -> None:
        """The worker gives up. Its prefill workers stop writing into its blocks; its
        clients are told each request failed (status 500), unless they are to fail
        over (it stalled, or lost a tensor-parallel rank): then the router resubmits
        them to another decode worker once this one is reported down."""
        for request_id, client in self.requests.items():
            prefill = client.prefill
            sock = self.dealers.get(prefill) if prefill is not None else None
            if sock is not None and prefill is not None:
                self.send_now(sock, prefill.encode(), encode(Abort(request_id=request_id)))
        if fail_over:
            return
        for request_id, client in self.requests.items():
            if client.members is None:  # a group's own id names no request the router awaits
                self.send_now(client.sock, client.sender,
                              encode(Rejected(request_id=request_id, error=error, status=500)))

    def check_engine(self) -> None:
        self.core.engine.check_health()

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
                self._fail(request_id, error, 400 if exc.at_fault else 500, exc.param)
            self._fail_corrupted()
            self.step_failed(exc)  # several in a row: the device is broken (fatal)
            return
        if out.num_tokens or out.finished:
            self.progressed()
            self.step_succeeded()
        self._fail_corrupted()
        finished = {r.request_id for r in out.finished}
        now = time.monotonic()
        for request in {r.request_id: r for r in out.advanced + out.finished}.values():
            rid = request.request_id
            client = self.requests.get(rid)
            if client is None:
                continue
            sent = client.sent
            new = request.output_token_ids[sent:]
            client.sent += len(new)
            if new and client.first_token is None:
                client.first_token = now
            logprobs = []
            if request.sampling_params.logprobs is not None:
                logprobs = [(lp.logprob, list(lp.top)) for lp in request.output_logprobs[sent:sent + len(new)]]
            done = rid in finished
            prompt_logprobs = []
            if not sent and request.prompt_logprobs is not None:  # with the first tokens
                prompt_logprobs = [_prompt_token(lp) for lp in request.prompt_logprobs.entries]
            self.send(client.sock, client.sender, encode(Tokens(
                request_id=rid, tokens=new, finished=done, reason=request.status.value if done else "",
                cached=request.num_cached_tokens, logprobs=logprobs, phases=self._phases(request, now) if done else {},
                remote=done and self.core.kv_ready_at(client.group or rid) is not None, prompt_logprobs=prompt_logprobs)))
            if done:
                del self.requests[rid]
                self.core.forget(rid)
                if client.group is not None:
                    self._ended_in_group(client.group, rid)

    def _fail_corrupted(self) -> None:
        """Requests the core aborted because a late KV write overwrote their blocks
        (decode_worker/remote_kv.py): the router resubmits each (prompt + the tokens
        it has streamed), as after a failover; a frozen prefill worker costs none."""
        corrupted, self.core.corrupted = self.core.corrupted, []
        for request_id in corrupted:
            self._fail(request_id, "its KV cache blocks were overwritten by a late KV write", retry=True)

    def _phases(self, request: Request, now: float) -> dict[str, float]:
        """Seconds per phase, router/metrics.py defines them. A request whose remote
        prefill failed over counts as prefilled here."""
        t = self.requests[request.request_id]
        first_token = t.first_token if t.first_token is not None else now
        scheduled = request.first_scheduled_time or now
        kv_ready = self.core.kv_ready_at(t.group or request.request_id)
        remote = self.requests.get(t.group, t) if t.group is not None else t  # who heard from the prefill worker
        phases = {"decode": now - first_token}
        if kv_ready is not None:
            phases["queue"] = max(0.0, scheduled - kv_ready)
            if remote.remote_compute_s is not None:  # else its prefill_done is still on the way
                assert remote.remote_transfer_s is not None  # _prefill_done sets both
                phases.update(prefill=remote.remote_compute_s, kv_write=remote.remote_transfer_s,
                              transfer=max(0.0, kv_ready - t.arrived - remote.remote_compute_s))
        else:
            phases.update(queue=max(0.0, scheduled - t.arrived), prefill=max(0.0, first_token - scheduled))
        return phases

    def stats(self) -> WorkerStats:
        engine, core, transport = self.core.engine.stats(), self.core, self.core.transport
        return self.worker_stats(
            engine, core.steps, transport, waiting_for_kv=len(core.waiting_for_kv),
            quarantined_blocks=core.quarantined_blocks(), remote=core.stats["remote"], local=core.stats["local"],
            fallbacks=core.stats["fallbacks"], fenced_refusals=core.stats["fenced_refusals"],
            saturated=self.transfer["saturated"], kv_bytes_received=self.transfer["kv_bytes_received"],
            kv_transfer_seconds=self.transfer["kv_transfer_seconds"],
            kv_transfer_failures=self.transfer["kv_transfer_failures"],
            late_writes_dropped=transport.stats["late_writes_dropped"], kv_overwritten=transport.stats["overwritten"],
            kv_overwritten_in_use=transport.stats["overwritten_in_use"],
            spec_decode=SpecDecodeStats(**asdict(engine.spec)) if engine.spec is not None else None)


def _prompt_token(entry: TokenLogprobs) -> PromptTokenLogprobs:
    """A prompt token's entry as Tokens carries it."""
    assert entry.rank is not None  # prompt logprobs' entries always have their rank (engine/prompt_logprobs.py)
    return entry.logprob, entry.rank, list(entry.top)


def _step_error(exc: RequestsFailed) -> str:
    """What a request's client is told when the step it was in failed."""
    if exc.param is not None:  # its own parameter: the message names it
        return str(exc)
    if exc.at_fault:
        return ("nothing could be sampled for this request: its logits were NaN, +inf, or -inf for every "
                "token (after its penalties and min_tokens masking)")
    return f"the engine step this request was in failed: {exc}"


def serve(config: WorkerConfig, control: ControlChannel) -> None:
    """Worker entry point: start (sockets on config.host), report ready on `control`,
    get peers, run (workers/control.py)."""
    engine, transport = engine_and_transport(config)
    worker = DecodeWorker(config.name, DecodeWorkerCore(engine, transport, config.prefill_deadline_s),
                          config.prefill_max_outstanding, config.host, config.stall_timeout_s, config.stall_grace_s,
                          config.secret)
    run_worker(worker, control, transport)
