"""The event loop every worker process runs: ZMQ messages in, one engine step, repeat.

How a worker fails (engine/errors.py says what the engine raises):

- `RequestsFailed` from a step: the step is void and names its requests; the worker
  ends just those (decode: an error to each client; prefill: `prefill_done` with the
  error, so the decode worker prefills locally) and goes on serving. Several steps in
  a row failing that way (MAX_FAILED_STEPS_IN_A_ROW, with no step in between that
  worked) means the device or model is broken, not the requests: that is fatal.
- Anything else escaping a step or the handling of a message (`EngineStateError`, a
  bug): fatal. The worker logs the traceback at ERROR, tells the client of every
  request it holds that it failed, closes its sockets (flushing those messages), and
  raises `WorkerFailed` out of `run()`: the process exits non-zero (under Ray the
  actor ends its process), and its launcher's supervisor reports it down and restarts
  it (cluster/).
- `RankFailure` (a tensor-parallel rank died or stalled): fatal the same way, but the
  requests are not at fault: the decode worker does not fail them; the router fails
  them over to another decode worker once this one is reported down.
- No progress (`router.stall_timeout_s`, StallWatchdog): the worker has work in its
  engine's queues and no step has computed a token for that long. It says so in its
  stats replies (`stalled`, `no_progress_s`: the router then stops routing to it and
  fails its requests over), logs why at ERROR, and after `stall_grace_s` more exits
  non-zero the same way, without failing its decode requests (they fail over). A loop
  that does not come round at all (a step that never returns: a hung kernel, a
  deadlock) is ended by a thread (HangWatchdog) once it has not come round for
  stall_timeout_s + stall_grace_s.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from engine.errors import RankFailure, RequestsFailed
from kv_transfer import KVTransport
from protocol import CONTROL_MESSAGES, WORKER_MESSAGES, Message, MessageError, Peers, Ready, Serving, Stop, encode
from protocol.stats import KVTierStats, WorkerStats
from security import DeploymentSecret, PlaneGuard, connect_securely, serve_securely
from workers.control import ControlChannel
from workers.watchdog import HangWatchdog, StallWatchdog

if TYPE_CHECKING:
    from engine.engine_core import EngineStats
    from workers.step_metrics import StepMetrics

logger = logging.getLogger(__name__)

# RequestsFailed from this many steps in a row (no good step between them) is fatal: a
# broken device (a CUDA error is sticky) would otherwise fail every request forever.
MAX_FAILED_STEPS_IN_A_ROW = 3
# How long a failing worker's last messages (errors to its clients) may take to leave.
FAREWELL_LINGER_MS = 2000


def run_worker(worker: WorkerLoop, control: ControlChannel, transport: KVTransport) -> None:
    """A worker process's life (its `serve` entry point): WorkerLoop.serve; a worker
    that gave up (already logged, its clients told) ends the process with status 1, so
    that its supervisor restarts it. (Under Ray the loop runs in an actor's thread,
    where this re-raises; the actor ends its process.)"""
    try:
        worker.serve(control, transport)
    except WorkerFailed as exc:
        if threading.current_thread() is not threading.main_thread():
            raise
        logger.error("%s exits with status 1: %s", worker.name, exc)
        _flush_logs()
        raise SystemExit(1) from None


class WorkerFailed(RuntimeError):
    """The worker gave up (its cause chained): its process must exit non-zero, so that
    its supervisor restarts it."""


class WorkerStalled(WorkerFailed):
    """The worker made no progress for stall_timeout_s (and stall_grace_s more)."""


IDLE_POLL_MS = 10  # how long an idle worker waits for a message before looking again
# A worker whose work only waits on another process (pushed KV, a write's acknowledgement)
# looks again this soon: not at once, so that on a machine with few cores it does not
# spin a core away from the process it waits on.
WAIT_POLL_MS = 1


class WorkerLoop:
    """Subclasses implement set_peers(), handle() and step(), say when they have work
    (busy) and work a step could advance (pending), call progressed() when a step
    advances, and fail_all() their requests when the worker gives up."""

    def __init__(self, name: str, host: str = "127.0.0.1", stall_timeout_s: float | None = None,
                 stall_grace_s: float = 2.0, secret: DeploymentSecret | None = None) -> None:
        """stall_timeout_s: router.stall_timeout_s (None or 0: no stall detection);
        stall_grace_s: how long a stalled worker still answers (stalled) before it exits;
        secret: the deployment's (security/): every socket is CURVE, and only peers
        holding it get a message through (None: plain sockets, for a loop made alone in
        a test)."""
        self.name = name
        self.secret = secret
        self.ctx = zmq.Context()
        # Before the socket binds: no handshake may come before the guard can answer it.
        self.guard = PlaneGuard(self.ctx, secret, name) if secret is not None else None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A peer restarted under the same name takes its routing id over at once.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if secret is not None:
            serve_securely(self.sock, secret)
        self.address = f"tcp://{host}:{self.sock.bind_to_random_port(f'tcp://{host}')}"
        if self.guard is not None:
            self.guard.watch(self.sock)
            self.guard.start()
        self.dealers: dict[str, zmq.Socket] = {}  # peer name -> our socket to it
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.clock: Callable[[], float] = time.monotonic
        self.stall_timeout_s = stall_timeout_s or None
        self.stall_grace_s = stall_grace_s
        self.watchdog = StallWatchdog(self.stall_timeout_s, stall_grace_s, self.clock())
        self._progressed = False
        self._iterations = 0  # loop iterations completed (HangWatchdog's heartbeat)
        self._failed_steps = 0  # steps in a row that raised RequestsFailed

    def connect(self, peer: str, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.name.encode())
        if self.secret is not None:
            connect_securely(sock, self.secret)
        sock.connect(address)
        self.dealers[peer] = sock
        self.poller.register(sock, zmq.POLLIN)
        return sock

    def disconnect(self, peer: str) -> None:
        sock = self.dealers.pop(peer, None)
        if sock is not None:
            self.poller.unregister(sock)
            sock.close(0)

    def set_peers(self, msg: Peers) -> list[str]:
        """Apply a Peers message (protocol/control.py): once before run(), and again
        whenever the launcher's supervisor reports a peer dead (left out) or restarted
        (back, with a new address and transport metadata). Makes the KV handshakes;
        returns the peers whose handshake failed."""
        raise NotImplementedError

    def serve(self, control: ControlChannel, transport: KVTransport) -> None:
        """The worker's life on its control channel (workers/control.py): report ready,
        take the first peers and make every handshake, report serving, run until told
        to stop; then close the transport. Raises WorkerFailed when the worker gave up
        (the process must then exit non-zero)."""
        try:
            control.send_bytes(encode(Ready(name=self.name, address=self.address, metadata=transport.metadata())))
            first = CONTROL_MESSAGES.decode(control.recv_bytes())
            if isinstance(first, Stop):  # stopped before it served
                self.close()
                return
            cold = self.set_peers(first)
            control.send_bytes(encode(Serving(cold=cold)))
            self.run(control)
        finally:
            transport.close()

    def handle(self, sender: bytes, msg: Message, reply: zmq.Socket) -> None:
        raise NotImplementedError

    def refuse(self, sender: bytes, error: MessageError, reply: zmq.Socket) -> None:
        """A message that is not one of ours (logged and dropped). A role answers one
        whose request it can name (error.kind, error.request_id)."""

    def step(self) -> None:
        raise NotImplementedError

    def check_engine(self) -> None:
        """Raise if the engine is broken while idle (a tensor-parallel rank gone)."""

    def busy(self) -> bool:
        raise NotImplementedError

    def runnable(self) -> bool:
        """Work a step can advance now; a role whose work can also wait on another
        process (busy() but not this) says so here."""
        return self.busy()

    def poll_ms(self) -> int:
        """How long the loop may wait for a message before its next step: 0 while a
        step has work, WAIT_POLL_MS while the work waits on another process (spinning
        would take a core from it), IDLE_POLL_MS with none."""
        if self.runnable():
            return 0
        return WAIT_POLL_MS if self.busy() else IDLE_POLL_MS

    def pending(self) -> bool:
        """Work a step could advance now (StallWatchdog); False: none, or only work
        waiting on something with its own deadline (pushed KV)."""
        return False

    def fail_all(self, error: str, fail_over: bool) -> None:
        """The worker gives up: tell whoever waits on each of its requests (no engine
        call: its state may be broken). `fail_over`: the requests are not at fault (it
        stalled, or a tensor-parallel rank was lost): the router fails its decode
        requests over to another worker instead, once this one is reported down."""

    # --- progress and failure bookkeeping, for subclasses ---

    def progressed(self) -> None:
        """A step computed tokens or finished requests, or KV was written."""
        self._progressed = True

    def step_failed(self, exc: RequestsFailed) -> None:
        """A step raised RequestsFailed (after its requests were ended): fatal when
        MAX_FAILED_STEPS_IN_A_ROW did with no good step between them. Failures the
        requests caused themselves (exc.at_fault) say nothing about the device and do
        not count: else any client could bring a healthy worker down."""
        if exc.at_fault:
            return
        self._failed_steps += 1
        if self._failed_steps >= MAX_FAILED_STEPS_IN_A_ROW:
            raise WorkerFailed(f"{self._failed_steps} engine steps in a row failed, the last with: {exc}; "
                               "the device or the model is broken, not the requests") from exc

    def step_succeeded(self) -> None:
        self._failed_steps = 0

    def worker_stats(self, engine: EngineStats, steps: StepMetrics, transport: KVTransport,
                     **role: Any) -> WorkerStats:
        """A stats reply's figures: those both roles have, from the engine, the step
        metrics, this loop's watchdog (stalled: for good, it exits soon) and the
        peers refused by its socket and its transport's; `role`: the role's own fields."""
        return WorkerStats(
            name=self.name, num_blocks=engine.num_blocks, free_blocks=engine.free_blocks, running=engine.running,
            waiting=engine.waiting, preemptions=engine.preemptions, ranks=list(engine.ranks),
            refused_peers=(self.guard.refused if self.guard is not None else 0) + transport.refused_peers(),
            stalled=self.watchdog.stalled, no_progress_s=round(self.watchdog.no_progress_s(self.clock()), 3),
            step_seconds=steps.seconds.snapshot(), step_requests=steps.requests.snapshot(),
            step_tokens=steps.tokens.snapshot(), step_seconds_by_requests=steps.by_requests.snapshot(),
            step_seconds_by_tokens=steps.by_tokens.snapshot(), kv_transport=transport.name, kv_fabric=transport.fabric,
            kv_tiers=KVTierStats.of(engine.offload),
            lora_adapters=list(engine.lora_adapters) if engine.lora_adapters is not None else None, **role)

    def run(self, control: ControlChannel) -> None:
        """Until the launcher says stop (or closes the control channel); a "peers"
        message on it meanwhile goes to set_peers(). Raises WorkerFailed when the worker
        gives up (module docstring), after telling its clients."""
        # Ctrl-C reaches the whole process group; the launcher decides when we stop.
        # Under Ray the loop runs in an actor's thread, where signals cannot be set (and
        # Ray, not a terminal, owns the actor process's signals).
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        hang = None
        if self.stall_timeout_s is not None:
            loop_thread = threading.get_ident()
            hang = HangWatchdog(self.stall_timeout_s + self.stall_grace_s,
                                lambda stuck_s: self._hung(stuck_s, loop_thread), lambda: self._iterations)
            hang.start()
        try:
            while True:
                if control.poll():
                    try:
                        message = control.recv_bytes()
                    except EOFError:  # the launcher is gone
                        break
                    message = CONTROL_MESSAGES.decode(message)
                    if isinstance(message, Stop):
                        break
                    self.set_peers(message)
                for sock, _ in self.poller.poll(self.poll_ms()):
                    self._drain(sock)
                self.step()
                if not self.busy():
                    self.check_engine()
                self._iterations += 1
                self._watch()
        except Exception as exc:
            self._give_up(exc)
        finally:
            if hang is not None:
                hang.stop()
        self.close()

    def _watch(self) -> None:
        now = self.clock()
        if self.watchdog.observe(now, self.pending(), self._progressed):
            logger.error("%s is stalled: it has had work for %.1f s and no step has computed a token "
                         "(router.stall_timeout_s = %g); it reports stalled and exits in %g s to be restarted",
                         self.name, self.watchdog.no_progress_s(now), self.stall_timeout_s, self.stall_grace_s)
        self._progressed = False
        if self.watchdog.must_exit(now):
            raise WorkerStalled(f"no progress for {self.watchdog.no_progress_s(now):.1f} s with work to do "
                                f"(router.stall_timeout_s = {self.stall_timeout_s:g})")

    def _give_up(self, exc: Exception) -> None:
        """Fatal: log, tell every client, flush, raise WorkerFailed (never returns)."""
        stalled = isinstance(exc, WorkerStalled)
        if stalled:
            logger.error("%s gives up: %s; exiting so that its supervisor restarts it", self.name, exc)
        else:
            logger.error("%s failed; failing every request it holds and exiting so that its supervisor "
                         "restarts it", self.name, exc_info=exc)
        reason = str(exc) if isinstance(exc, WorkerFailed) else f"{type(exc).__name__}: {exc}"
        try:
            self.fail_all(f"worker {self.name} failed ({reason}) and is being restarted",
                          stalled or isinstance(exc, RankFailure))
        except Exception:
            logger.exception("%s: telling its clients failed too", self.name)
        try:
            self.close(FAREWELL_LINGER_MS)
        except Exception:
            logger.exception("%s: closing its sockets failed", self.name)
        _flush_logs()
        if isinstance(exc, WorkerFailed):
            raise exc
        raise WorkerFailed(f"worker {self.name} failed: {reason}") from exc

    def _hung(self, stuck_s: float, loop_thread: int) -> None:
        """From the HangWatchdog's thread: the loop is stuck (in a step, most likely).
        Its sockets belong to that thread, so no client can be told: the process ends,
        and the router fails its requests over when the supervisor reports it down."""
        frame = sys._current_frames().get(loop_thread)
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(unknown)\n"
        logger.error("%s is hung: its loop has not come round for %.1f s (router.stall_timeout_s = %g, "
                     "+ %g s grace); exiting so that its supervisor restarts it. The loop is at:\n%s",
                     self.name, stuck_s, self.stall_timeout_s, self.stall_grace_s, where)
        _flush_logs()
        os._exit(1)

    def _drain(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if sock is self.sock:
                sender = frames[0]
            else:  # a peer we connected to: name it
                sender = next(name for name, s in self.dealers.items() if s is sock).encode()
            body = frames[-1]
            try:
                msg = WORKER_MESSAGES.decode(body)
            except MessageError as exc:
                logger.warning("%s dropped a message: %s", self.name, exc)
                self.refuse(sender, exc, sock)
                continue
            self.handle(sender, msg, sock)

    def send(self, sock: zmq.Socket, sender: bytes, body: bytes) -> None:
        """Reply on the socket the peer spoke on (ROUTER: addressed by its routing id)."""
        if sock is self.sock:
            sock.send_multipart([sender, body])
        else:
            sock.send(body)

    def send_now(self, sock: zmq.Socket, sender: bytes, body: bytes) -> None:
        """send() that never blocks (a worker giving up must not wait on a peer): a
        message that cannot leave now is dropped, with a warning."""
        try:
            if sock is self.sock:
                sock.send_multipart([sender, body], zmq.NOBLOCK)
            else:
                sock.send(body, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("%s could not send a last message: %s", self.name, exc)

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket; with linger_ms, messages already sent may take that long
        to leave (a failing worker's errors to its clients). Closing twice is harmless."""
        if self.ctx.closed:
            return
        for sock in self.dealers.values():
            sock.close(linger_ms)
        self.dealers = {}
        self.sock.close(linger_ms)
        if self.guard is not None:  # its sockets too, or term() would wait for them
            self.guard.close()
        self.ctx.term()


def _flush_logs() -> None:
    """Before the process ends: whatever the handlers (or stderr) still buffer."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.stderr, sys.stdout):
        try:
            stream.flush()
        except Exception:
            pass

