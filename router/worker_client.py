"""The router's connection to one worker: a DEALER socket, its health
(router/health.py) and, for a decode worker, the queues of the requests it serves.
Prefill workers are only pinged, for their health and figures.

A worker whose stats reply says `stalled` (it has work and has made no progress for
router.stall_timeout_s; it exits soon, workers/loop.py) is declared dead at once,
as a silent one would be after router.worker_timeout_s; nothing it sends during its
grace re-admits it, only a stats reply saying it is not stalled (router/health.py).

Who calls what: the worker pool (router/pool.py) starts `read_forever()` and one shared
monitor task for the app's lifetime; the monitor calls `ping()` and `check()` every
router.health_interval_s; a request's sequences (router/sequences.py) `subscribe()` to
the ids they await and `unsubscribe()` when done, and `send()`; /metrics calls `stats()`.
Everything runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol, cast

import zmq
import zmq.asyncio

from protocol import WORKER_MESSAGES, Message, MessageError, Rejected, Stats, StatsReply, Tokens, WorkerStats, encode
from router.health import WorkerHealth
from security import DeploymentSecret, connect_securely

logger = logging.getLogger(__name__)

# Put into a request's inbox when its worker is declared dead: the request fails over.
WORKER_LOST = object()


class Inbox(Protocol):
    """Where a request's messages go: its Tokens and Rejected, or WORKER_LOST."""

    def put_nowait(self, msg: Any) -> None: ...


class WorkerClient:
    def __init__(self, ctx: zmq.asyncio.Context, name: str, address: str, timeout_s: float,
                 secret: DeploymentSecret | None = None) -> None:
        """secret: the deployment's (security/): the socket is a CURVE client, which the
        worker's guard admits (None: plain, for a worker that has none, in tests)."""
        self.name = name
        self.address = address
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, f"router-{uuid.uuid4().hex[:8]}".encode())
        if secret is not None:
            connect_securely(self.sock, secret)
        self.sock.connect(address)
        self._inboxes: dict[str, Inbox] = {}  # request id -> where its messages go
        self._group_ids: set[str] = set()  # of those, parallel-sampling groups' own ids
        self.health = WorkerHealth(timeout_s, time.monotonic())
        self._stats_waiters: dict[int, asyncio.Future] = {}  # ping seq -> its reply
        # (events, reset): the worker's prefix-cache events, from every stats reply
        self.on_kv_events: Callable[[list, bool], None] | None = None
        self.num_kv_blocks: int | None = None  # its KV pool, once a stats reply said
        self.loras: set[str] = set()  # the LoRA adapters it holds read, as its last stats reply said (router/pool.py)
        self.on_stats: Callable[[WorkerStats], None] | None = None  # each stats reply's figures
        # (monotonic time, figures) of its latest stats reply, a ping's included: what
        # /status shows, with its age, of a worker too busy to answer within the wait.
        self.latest_stats: tuple[float, WorkerStats] | None = None
        self._seq = 0
        self.down_reason = "not answering yet"  # why it was last declared dead (the 503's message)
        # Being scaled down (cluster/elastic.py): it gets no new request, but stays alive
        # for those it serves.
        self.draining = False
        self.closed = False  # it left the deployment (close()): nothing more is sent

    @property
    def alive(self) -> bool:
        return self.health.alive

    async def read_forever(self) -> None:
        while True:
            try:
                msg = WORKER_MESSAGES.decode(await self.sock.recv())
            except MessageError as exc:  # e.g. a worker of another protocol version
                logger.warning("dropped a message from %s: %s", self.name, exc)
                continue
            stalled = isinstance(msg, StatsReply) and msg.stats.stalled
            if stalled:  # it answers, but makes no progress: as good as dead (and exits soon)
                if self.health.stall():
                    self._lose_requests(f"is stalled: no progress for {msg.stats.no_progress_s:.0f} s "
                                        "with work to do (router.stall_timeout_s)")
            elif self.health.heard(time.monotonic(), stepping=isinstance(msg, StatsReply)):
                logger.warning("worker %s answers again: in service again", self.name)
            if isinstance(msg, StatsReply):
                self.latest_stats = (time.monotonic(), msg.stats)
                self.num_kv_blocks = msg.stats.num_blocks
                self.loras = set(msg.stats.lora_adapters or ())
                if self.on_stats is not None:
                    self.on_stats(msg.stats)
                if (msg.kv_events or msg.kv_reset) and self.on_kv_events is not None:
                    self.on_kv_events(msg.kv_events, msg.kv_reset)
                waiter = self._stats_waiters.pop(msg.seq, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg.stats)
            elif isinstance(msg, (Tokens, Rejected)):
                inbox = self._inboxes.get(msg.request_id)
                if inbox is not None:
                    inbox.put_nowait(msg)

    def subscribe(self, request_id: str, inbox: Inbox, group: bool = False) -> None:
        """The worker's messages for `request_id` go to `inbox` until unsubscribe();
        `group`: a parallel-sampling group's own id (only a rejection of the whole group
        comes under it), not a sequence the router awaits."""
        self._inboxes[request_id] = inbox
        if group:
            self._group_ids.add(request_id)

    def unsubscribe(self, request_id: str) -> None:
        """Stop listening for `request_id` (nothing happens if nobody listens)."""
        self._inboxes.pop(request_id, None)
        self._group_ids.discard(request_id)

    @property
    def load(self) -> int:
        """The ids the router listens for here: what the routing policy weighs."""
        return len(self._inboxes)

    @property
    def sequences_awaited(self) -> int:
        """Sequences the router awaits from the worker (a group's own id does not count)."""
        return len(self._inboxes) - len(self._group_ids)

    def send(self, message: Message) -> bool:
        """Queue a message for the worker; False if it cannot be queued (the socket's
        buffer is full: the worker has been unreachable for a long time). Never blocks,
        so a dead worker cannot stall the router. A worker that left (close()) takes
        nothing: a request moved off it still aborts its old id there, and a stats
        request listed before it left still asks, after its socket is gone."""
        if self.closed:
            return False
        # With NOBLOCK the async socket sends at once and returns a finished future.
        # zmq.asyncio's send returns an asyncio Future (its stubs say only Awaitable).
        sent = cast(asyncio.Future, self.sock.send(encode(message), flags=zmq.NOBLOCK))
        error = sent.exception()
        if isinstance(error, zmq.Again):
            return False
        if error is not None:
            raise error
        return True

    def ping(self) -> None:
        """A stats request whose reply only counts as a sign of life."""
        self._seq += 1
        self.send(Stats(seq=self._seq))

    async def stats(self, timeout: float = 2.0) -> WorkerStats | None:
        """The worker's own figures, or None if it does not answer in time."""
        self._seq += 1
        seq = self._seq
        waiter = asyncio.get_running_loop().create_future()
        self._stats_waiters[seq] = waiter
        try:
            if not self.send(Stats(seq=seq)):
                return None
            return await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            return None
        finally:
            self._stats_waiters.pop(seq, None)

    def check(self) -> bool:
        """True if the worker has just been declared dead; then every request it was
        serving is told so (WORKER_LOST), to fail over."""
        if not self.health.expired(time.monotonic()):
            return False
        self._lose_requests(f"sent nothing for {self.health.timeout_s:g} s")
        return True

    def declare_dead(self, reason: str) -> None:
        """Someone who knows (a supervisor) says the worker is down: fail its
        requests over now rather than after the health timeout."""
        if self.health.kill():
            self._lose_requests(reason)

    def move(self, address: str) -> None:
        """The worker was restarted at `address`. It stays dead to routing until it
        answers (the next ping goes there); nothing sent to the old process will come
        back, so any request still waiting on it fails over."""
        if self._inboxes:
            self._lose_requests("restarted")
        self.down_reason = "was restarted and has not answered yet"
        self.health.kill()
        self.sock.disconnect(self.address)
        self.address = address
        self.sock.connect(address)

    def evacuate(self, reason: str) -> None:
        """Move every request it serves to another worker by the failover path (it is
        being drained and its time is up); it stays alive meanwhile, for their aborts."""
        self._lose_requests(reason, declared_dead=False)

    def close(self) -> None:
        """It left the deployment: its socket goes (any request still listening fails
        over first)."""
        if self._inboxes:
            self._lose_requests("left the deployment", declared_dead=False)
        self.closed = True
        self.sock.close(linger=0)

    def _lose_requests(self, reason: str, declared_dead: bool = True) -> None:
        if declared_dead:
            self.down_reason = reason
        logger.warning("worker %s (%s) %s%s%s", self.name, self.address, reason,
                       ": declared dead" if declared_dead else "",
                       f"; {len(self._inboxes)} request(s) fail over" if self._inboxes else "")
        for inbox in list(self._inboxes.values()):
            inbox.put_nowait(WORKER_LOST)
