"""The KV transport interface, and the bookkeeping every transport shares.

Who calls what, and when (P = prefill worker, the sender; D = decode worker, the receiver):

    both    t = create_transport(name, agent_name, config)
            cache = t.allocate_kv_cache(shape, dtype, device)  # where peers can reach it
            t.register_kv_cache(cache, model)                   # once, before metadata()
            blob = t.metadata()      # bytes: handed to peers over the caller's own channel
    D       t.expect(req, epoch, blocks, deadline)  # before telling P those blocks
    P       peer = t.add_peer(blob_of_D)            # refused, naming the field, if incompatible
            xfer = t.write(peer, req, epoch, src_blocks, dst_blocks, deadline)
                     # the source blocks must stay unchanged until the write is done or failed
            t.cancel(req)                           # stop writing it (e.g. the request died)
    both    events = t.poll()                       # never blocks; call every step
                     # D: Overwritten means blocks it reused hold a late write's bytes
    D       t.abort(req)                            # the request died or fell back to local
    both    t.close()

A write is one request's list of blocks and carries one notification (request id and
epoch). It moves as one descriptor per run of consecutive blocks (block-major layout:
a block of every layer is one region). It is done when D acknowledged it, and failed
when D refused it or no acknowledgement came within `timeout_s`: a dead peer is an
error within that deadline, never a hang. A write whose bytes are still moving when it
is cancelled or times out fails once they have landed (or the data plane reports an
error), never before: until its WriteFailed, P must not reuse its source blocks, and
P's cancel_ack, which lets D reuse the destination blocks, waits for it too. Likewise
no write is reported done or failed while its data plane still reads its source
blocks (`_source_in_use`): tcp sends them zero-copy, so a write whose frames ZMQ still
holds (queued for a peer that does not read, or is dead: ZMQ keeps them for a
reconnection) ends only once ZMQ lets go of them. When such a write times out, or
peer_gone() is called, the control socket to that peer is closed (linger 0, and
replaced unless the peer is gone), which drops them: ZMQ lets go within a millisecond
(measured), and the write fails at a later poll.

D accepts a write only into blocks it reserved for that request and epoch, before
the reservation's deadline. A late write (aborted, expired or unknown request) is
dropped and counted. One-sided transports (shm, nixl, cuda_ipc) land bytes before D
can look at them, so D keeps the blocks of an aborted or expired reservation out of
use until P confirms it will write no more (cancel_ack), or until deadline +
cancel_grace_s, after which P refuses to start any write for it (P checks the deadline
before every write, and shm again when its copy actually starts; shm also stops a copy
still running at deadline + cancel_grace_s / 2, between two chunks of at most 64 MiB).
`Released` tells D when the blocks are safe to reuse. Should the bytes of a one-sided
write land after all once its blocks were released (a data plane slower than those
bounds, or a sender declared gone that was not), its notification says so: D reports
`Overwritten` with the blocks whose contents are then unknown, for a while after the
release (until deadline + 2 * cancel_grace_s + timeout_s, at most MAX_RELEASED
reservations); their user must treat them as corrupt.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import zmq

from kv_transfer.compat import IncompatiblePeerError, KVCompat
from kv_transfer.messages import CONTROL, MessageError, decode, encode
from kv_transfer.runs import coalesce

logger = logging.getLogger(__name__)

HANDSHAKE_VERSION = 1
# D remembers at most this many released one-sided reservations (their blocks), to name
# the blocks a write landing after all overwrote (Overwritten); the oldest go first.
MAX_RELEASED = 4096


@dataclass(frozen=True)
class TransportConfig:
    timeout_s: float = 10.0  # a write not acknowledged within this fails
    # After a reservation's deadline, D releases its blocks without waiting for a
    # cancel_ack once this has passed too (module docstring): it must exceed the time
    # the bytes of a write started just before the deadline can take to land. shm
    # enforces it (a copy still running at deadline + cancel_grace_s / 2 stops); where
    # it is not met, D reports the blocks overwritten after their release (Overwritten).
    cancel_grace_s: float = 10.0
    host: str = "127.0.0.1"  # where this agent's control socket listens
    # nixl: drive UCX from a background thread. Off, progress happens in poll(), which
    # is faster on small CPU hosts (measured: 1.5 -> 2.5-3 GiB/s on 2 cores).
    progress_thread: bool = False

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not self.cancel_grace_s > 0:
            raise ValueError(f"cancel_grace_s must be > 0, got {self.cancel_grace_s}")


# ------------------------------------------------------------------------------ events

@dataclass(frozen=True)
class WriteDone:  # P: D acknowledged the write
    xfer: int
    peer: str
    req: str
    epoch: int


@dataclass(frozen=True)
class WriteFailed:  # P: refused, timed out, cancelled, or the data plane failed
    xfer: int
    peer: str
    req: str
    epoch: int
    reason: str


@dataclass(frozen=True)
class Received:  # D: these reserved blocks hold the data now
    req: str
    epoch: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class Completed:  # D: every reserved block was written
    req: str
    epoch: int


@dataclass(frozen=True)
class Expired:  # D: the deadline passed before every block was written
    req: str
    epoch: int


@dataclass(frozen=True)
class Released:  # D: blocks of an aborted or expired reservation may be reused
    req: str
    epoch: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class Overwritten:  # D: a one-sided write of a released reservation landed after all
    req: str  # the released reservation's request and epoch
    epoch: int
    blocks: tuple[int, ...]  # the blocks it landed in: their contents are unknown now


Event = WriteDone | WriteFailed | Received | Completed | Expired | Released | Overwritten


# ------------------------------------------------------------------------------ state

@dataclass
class _Reservation:  # D side
    epoch: int
    blocks: set[int]
    deadline: float
    sender: str | None  # agent name of the writer, once known
    pending: set[int] = field(default_factory=set)


@dataclass
class _Write:  # P side
    xfer: int
    peer: str
    req: str
    epoch: int
    dst: list[int]
    runs: list[tuple[int, int, int]]
    started: float
    deadline: float  # the reservation's (time.time())
    handle: Any = None  # the data plane's handle while it moves bytes (tcp: its frames' ZMQ tracker)
    notified: bool = False  # the "written" message went out; waiting for the ack
    # Cancelled or timed out while its bytes were moving: it fails (with this reason)
    # once they have landed, never before (see _notify_when_landed).
    failure: str | None = None


@dataclass
class _Peer:
    name: str
    compat: KVCompat
    socket: zmq.Socket
    data: dict[str, Any]
    metadata: bytes  # as add_peer() got it: new bytes under the same name = a restart
    session: str  # the peer's KVTransport.session
    control: str = ""  # the address of its control socket


def _covered(runs: Any) -> set[int] | None:
    """Blocks covered by [[dst_start, count], ...], or None if malformed."""
    try:
        return {d + i for d, n in runs for i in range(n)
                if isinstance(d, int) and isinstance(n, int) and 0 < n}
    except (TypeError, ValueError):
        return None


class KVTransport(ABC):
    """Base class: the control channel (ZMQ, msgpack), reservations, deadlines, events.

    Subclasses move the bytes: see the abstract methods below.
    """

    name = "base"
    one_sided = False  # True: bytes land without the receiver's involvement

    def __init__(self, agent_name: str, config: TransportConfig | None = None) -> None:
        self.agent_name = agent_name
        self.config = config or TransportConfig()
        self.kv_cache: torch.Tensor | None = None
        self.compat: KVCompat | None = None
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        # A restarted sender reconnects under the same identity: it takes over at once.
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # New for every transport object: tells a restarted agent (same name) from the
        # one before it, so no write meant for the old one reaches the new one.
        self.session = uuid.uuid4().hex
        port = self._router.bind_to_random_port(f"tcp://{self.config.host}")
        self.control_address = f"tcp://{self.config.host}:{port}"
        self._peers: dict[str, _Peer] = {}
        self._reservations: dict[str, _Reservation] = {}  # D: live, by request
        self._quarantine: dict[tuple[str, int], _Reservation] = {}  # D: dead, not yet released
        self._writes: dict[int, _Write] = {}
        # P: (req, epoch) never to be written -> its reservation's deadline, after which
        # write() refuses it anyway (so the entry can go).
        self._cancelled: dict[tuple[str, int], float] = {}
        self._acks_due: dict[tuple[str, int], _Peer] = {}  # P: cancels to confirm once landed
        # P: writes that ended (the event to report) while the data plane still reads their
        # source blocks (_source_in_use): reported once it no longer does.
        self._ending: dict[int, tuple[_Write, Event]] = {}
        # D, one-sided: released (req, epoch) -> (its blocks, its deadline, until when a
        # write landing for it is reported as Overwritten), oldest first, MAX_RELEASED at most.
        self._released: OrderedDict[tuple[str, int], tuple[tuple[int, ...], float, float]] = OrderedDict()
        self._xfer_ids = itertools.count(1)
        self._events: list[Event] = []
        self.stats: dict[str, int] = dict(writes=0, writes_done=0, writes_failed=0, bytes_written=0,
                                          descriptors=0, late_writes_dropped=0, expired=0, overwritten=0)

    # ------------------------------------------------------------------ subclass hooks

    def allocate_kv_cache(self, shape: Sequence[int], dtype: torch.dtype, device: str) -> torch.Tensor:
        """Memory for the local cache that peers of this transport can reach."""
        return torch.zeros(tuple(shape), dtype=dtype, device=device)

    @abstractmethod
    def _register(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        """Register the cache with the data plane; returns what peers need (msgpack-able)."""

    @abstractmethod
    def _connect(self, peer: _Peer) -> None:
        """Prepare to write into `peer` (its data-plane metadata is peer.data)."""

    @abstractmethod
    def _start(self, peer: _Peer, write: _Write) -> None:
        """Begin moving write.runs (src_start, dst_start, count) into the peer's cache.

        Two-sided transports send the data with the notification instead: they
        implement _data_frames and leave this empty."""

    def _progress(self, write: _Write) -> bool:
        """One-sided: True once the bytes have landed (raise on a data-plane error)."""
        return True

    def _source_in_use(self, write: _Write) -> bool:
        """True while the data plane may still read the write's source blocks after its
        outcome is known (tcp: its frames, sent zero-copy, are still queued in ZMQ; shm: its
        copy still runs when the peer is declared gone). Its WriteDone / WriteFailed, on
        which the caller reuses those blocks, waits until this is False. Must not block."""
        return False

    def _data_frames(self, write: _Write) -> list[Any]:
        """Two-sided: the data sent with the notification, one frame per run."""
        return []

    def _send_notification(self, peer: _Peer, write: _Write) -> None:
        """Tell the receiver the write has landed. Transports whose data plane delivers
        a notification after the data (NIXL) attach _header(write) there instead."""
        peer.socket.send_multipart([self._header(write), *self._data_frames(write)], copy=False)

    def _incoming_notifications(self) -> list[tuple[bytes, bytes]]:
        """(sender agent name, "written" message) pairs from the data plane, if it has any."""
        return []

    def _abandon(self, write: _Write) -> None:
        """Free the data plane's resources of a write that failed or timed out."""

    def _apply(self, sender: str, xfer: int, runs: list[list[int]], frames: list[Any]) -> None:
        """Two-sided, on D: put write `xfer`'s data into the local cache (runs: dst_start,
        count); `frames` are whatever came with the notification."""
        raise NotImplementedError

    def _discard(self, sender: str, xfer: int, runs: list[list[int]]) -> None:
        """Two-sided, on D: consume and drop the data of a refused write, if it comes
        separately from the notification."""

    def _on_join(self, sender: str, session: str) -> None:
        """On D: a sender asked to set up a pairwise data channel (`session`: new for
        each of its connections)."""

    def _warm(self, peer: _Peer) -> None:
        """Make whatever _connect() left to the first write (connections, groups)."""

    def _disconnect(self, name: str) -> None:
        """Free what _connect() (as sender) or _on_join() (as receiver) set up for a
        peer that is gone. It is dead: nothing here may wait for it."""

    def _close(self) -> None:
        pass

    # ------------------------------------------------------------------ setup

    def register_kv_cache(self, kv_cache: torch.Tensor, model: str, tp_rank: int = 0,
                          tp_size: int = 1) -> None:
        if self.kv_cache is not None:
            raise RuntimeError("a KV cache is already registered with this transport")
        self.compat = KVCompat.from_cache(kv_cache, model, tp_rank, tp_size)
        self.kv_cache = kv_cache
        self._blocks_bytes = kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)
        self._data_meta = self._register(kv_cache)

    def metadata(self) -> bytes:
        """The handshake blob for peers: who we are, where we listen, what we hold."""
        if self.compat is None:
            raise RuntimeError("register_kv_cache() first")
        return msgpack.packb({"v": HANDSHAKE_VERSION, "name": self.agent_name, "transport": self.name,
                              "session": self.session, "control_version": CONTROL.version,
                              "control": self.control_address, "compat": self.compat.to_dict(),
                              "num_blocks": self.kv_cache.shape[0], "data": self._data_meta},
                             use_bin_type=True)

    def add_peer(self, metadata: bytes) -> str:
        """Connect to a receiver from its metadata(); returns its agent name."""
        if self.compat is None:
            raise RuntimeError("register_kv_cache() first")
        try:
            meta = msgpack.unpackb(metadata, raw=False)
        except Exception as exc:
            raise IncompatiblePeerError(f"unreadable handshake metadata: {exc}") from None
        if not isinstance(meta, dict) or meta.get("v") != HANDSHAKE_VERSION:
            raise IncompatiblePeerError(f"handshake version {meta.get('v') if isinstance(meta, dict) else meta!r}, "
                                        f"this agent speaks {HANDSHAKE_VERSION}")
        missing = [k for k in ("name", "control", "compat", "num_blocks", "data") if k not in meta]
        if missing:
            raise IncompatiblePeerError(f"handshake metadata lacks {', '.join(missing)}")
        name = meta["name"]
        if meta.get("transport") != self.name:
            raise IncompatiblePeerError(f"peer {name!r} is incompatible: transport is "
                                        f"{meta.get('transport')!r} there, {self.name!r} here")
        if meta.get("control_version") != CONTROL.version:  # its messages would all be dropped
            raise IncompatiblePeerError(f"peer {name!r} is incompatible: control messages are version "
                                        f"{meta.get('control_version')!r} there, {CONTROL.version} here")
        compat = KVCompat.from_dict(meta["compat"])
        self.compat.check_peer(compat, name)
        if name in self._peers:
            if self._peers[name].metadata == metadata:
                return name
            # Same agent name, new metadata: the peer was restarted (new process, new
            # cache and control socket). The old one is dead.
            self.peer_gone(name)
        peer = _Peer(name, compat, self._dealer(meta["control"]), dict(meta["data"], num_blocks=meta["num_blocks"]),
                     bytes(metadata), str(meta.get("session", "")), meta["control"])
        self._connect(peer)
        self._peers[name] = peer
        return name

    def _dealer(self, address: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.agent_name.encode())
        sock.connect(address)
        return sock

    def _reconnect(self, peer: _Peer) -> None:
        """Replace the control socket to `peer`, dropping whatever is still queued on it
        (linger 0): the frames of writes that timed out, which ZMQ would otherwise keep,
        reading their source blocks, for as long as the peer does not read (forever if
        it is dead). Also lost: later writes' frames (they time out), cancel_acks (the
        peer releases after cancel_grace_s), and messages from it in flight. Its
        ROUTER takes the new connection over (ROUTER_HANDOVER)."""
        logger.warning("dropping the messages still queued for %r: writes to it timed out with their "
                       "data unsent", peer.name)
        peer.socket.close(0)
        peer.socket = self._dealer(peer.control)

    def warm_up(self, name: str) -> None:
        """Finish the handshake with peer `name` now rather than on the first write (the
        receiver must be polling meanwhile). Raises if it cannot be made."""
        self._warm(self._peers[name])

    def peer_session(self, name: str) -> str | None:
        """The session of the agent `name` we write to now (None: not a peer). A write
        meant for another session of it (one that died) must not start."""
        peer = self._peers.get(name)
        return peer.session if peer is not None else None

    def peer_gone(self, name: str) -> None:
        """The process of agent `name` is gone (its supervisor says so). As sender: our
        writes to it fail now (reported once the data plane no longer reads their source
        blocks: at once, or at a later poll), and it is forgotten (add_peer it again once
        restarted). As receiver: the reservations it was writing are released at once,
        since a dead sender can land nothing more (no cancel_ack will come from it)."""
        peer = self._peers.pop(name, None)
        if peer is not None:
            # First: linger 0 drops the frames still queued for it (tcp sends them from
            # the cache, zero-copy), so that ZMQ lets go of our source blocks at once and
            # the writes below can fail (they do once it has: _source_in_use).
            peer.socket.close(0)
            for w in [w for w in self._writes.values() if w.peer == name]:
                self._fail(w, f"peer {name!r} is gone")
            self._acks_due = {k: p for k, p in self._acks_due.items() if p is not peer}
        self._disconnect(name)
        for req, r in [(q, r) for q, r in self._reservations.items() if r.sender == name]:
            del self._reservations[req]
            self._remember_released(req, r)
            self._events.append(Released(req, r.epoch, tuple(sorted(r.blocks))))
        for (req, epoch), r in list(self._quarantine.items()):
            if r.sender == name:
                self._release(req, epoch)

    # ------------------------------------------------------------------ sender (P)

    def write(self, peer: str, req: str, epoch: int, src_blocks: Sequence[int],
              dst_blocks: Sequence[int], deadline: float) -> int:
        """Start writing local src_blocks into the peer's dst_blocks; returns the xfer id.

        The outcome arrives as WriteDone or WriteFailed from poll(). Refused at once
        (as WriteFailed) after the deadline or a cancel for (req, epoch)."""
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}; add_peer() it first")
        num_blocks = self.kv_cache.shape[0]
        peer_blocks = self._peers[peer].data["num_blocks"]
        for name, blocks, limit in (("source", src_blocks, num_blocks), ("destination", dst_blocks, peer_blocks)):
            bad = [b for b in blocks if not (isinstance(b, int) and 0 <= b < limit)]
            if bad:
                raise ValueError(f"{name} block ids out of range [0, {limit}): {bad[:5]}")
        if not src_blocks:
            raise ValueError("a write needs at least one block")
        xfer = next(self._xfer_ids)
        w = _Write(xfer, peer, req, epoch, list(dst_blocks), coalesce(src_blocks, dst_blocks), time.monotonic(),
                   deadline)
        self._writes[xfer] = w
        self.stats["writes"] += 1
        if (req, epoch) in self._cancelled:
            self._fail(w, "cancelled")
        elif time.time() > deadline:
            self._fail(w, "deadline passed before the write started")
        else:
            try:
                self._start(self._peers[peer], w)
            except Exception as exc:
                self._fail(w, f"data plane error: {exc}")
                return xfer
            self.stats["descriptors"] += len(w.runs)
            try:
                self._notify_when_landed(w)
            except Exception as exc:  # e.g. a copy that already failed (shm: started too late)
                self._fail(w, f"data plane error: {exc}")
        return xfer

    def cancel(self, req: str) -> None:
        """Stop writing `req`: writes whose notification has not gone out fail (once
        their bytes, if moving, have landed); nothing new starts for it."""
        for w in list(self._writes.values()):
            if w.req == req:
                self._cancel_write(w)

    def _cancel_write(self, w: _Write) -> None:
        self._cancelled[(w.req, w.epoch)] = w.deadline
        if not w.notified:
            w.failure = w.failure or "cancelled"
            self._notify_when_landed(w)

    def _notify_when_landed(self, w: _Write) -> None:
        """Send the notification of a write whose bytes have landed; or fail it then, if
        it was cancelled or timed out meanwhile. A write fails only once the data plane
        is done with it: its source blocks may be reused, and its destination blocks
        released (cancel_ack), only then."""
        if w.notified:
            return
        try:
            landed = self._progress(w)
        except Exception as exc:  # e.g. a copy that never started (shm: too late): nothing landed
            self._fail(w, f"data plane error: {exc}")
            return
        if not landed:
            return
        if w.failure is not None:
            peer = self._peers.get(w.peer)
            if self.one_sided and peer is not None:
                # Its bytes did land: D must hear of them, or it could not tell whether
                # they landed in blocks it has released since (Overwritten). D refuses
                # the write (or accepts it, if its reservation still stands: the bytes
                # are good); either way its ack finds no write here any more.
                peer.socket.send(self._header(w))
            self._fail(w, w.failure)
            return
        self._send_notification(self._peers[w.peer], w)
        w.notified = True

    @staticmethod
    def _header(w: _Write) -> bytes:
        return encode("written", xfer=w.xfer, req=w.req, epoch=w.epoch, blocks=w.dst,
                      runs=[[d, n] for _, d, n in w.runs])

    def _fail(self, w: _Write, reason: str) -> None:
        self._writes.pop(w.xfer, None)
        self._end(w, WriteFailed(w.xfer, w.peer, w.req, w.epoch, reason))

    def _end(self, w: _Write, event: WriteDone | WriteFailed) -> None:
        """Report the outcome of a write that left self._writes, once the data plane no
        longer reads its source blocks (the caller reuses them on this event)."""
        if self._source_in_use(w):
            self._ending[w.xfer] = (w, event)
            return
        self._ending.pop(w.xfer, None)
        if isinstance(event, WriteDone):
            self.stats["writes_done"] += 1
            self.stats["bytes_written"] += sum(n for *_, n in w.runs) * self.compat.block_bytes
        else:
            try:
                self._abandon(w)
            except Exception as exc:  # cleanup must not hide the failure being reported
                logger.warning("could not release write %d's data-plane resources: %s", w.xfer, exc)
            self.stats["writes_failed"] += 1
        self._events.append(event)

    # ------------------------------------------------------------------ receiver (D)

    def expect(self, req: str, epoch: int, blocks: Sequence[int], deadline: float,
               sender: str | None = None) -> None:
        """Reserve `blocks` for writes of (req, epoch) until `deadline` (time.time()).

        `sender` (its agent name), when known, lets an abort reach it at once."""
        if req in self._reservations:
            raise ValueError(f"request {req!r} already has a live reservation")
        bad = [b for b in blocks if not (isinstance(b, int) and 0 <= b < self.kv_cache.shape[0])]
        if bad or not blocks:
            raise ValueError(f"reserved block ids must be in [0, {self.kv_cache.shape[0]}), got {list(blocks)[:5]}")
        self._reservations[req] = _Reservation(epoch, set(blocks), deadline, sender, set(blocks))

    def holds_reservations(self) -> bool:
        """D: some reserved blocks are not back yet: live reservations, or dead ones
        waiting for Released (by deadline + cancel_grace_s at the latest)."""
        return bool(self._reservations or self._quarantine)

    def abort(self, req: str) -> None:
        """Drop the reservation; Released follows once its blocks are safe to reuse."""
        r = self._reservations.pop(req, None)
        if r is not None:
            self._kill(req, r)

    def _kill(self, req: str, r: _Reservation) -> None:
        if not self.one_sided:  # we apply every byte ourselves: nothing can land any more
            self._events.append(Released(req, r.epoch, tuple(sorted(r.blocks))))
            return
        self._quarantine[(req, r.epoch)] = r
        if r.sender is not None:
            self._router.send_multipart([r.sender.encode(), encode("cancel", req=req, epoch=r.epoch,
                                                                   deadline=r.deadline)])

    def _release(self, req: str, epoch: int) -> None:
        r = self._quarantine.pop((req, epoch), None)
        if r is not None:
            self._remember_released(req, r)
            self._events.append(Released(req, epoch, tuple(sorted(r.blocks))))

    def _remember_released(self, req: str, r: _Reservation) -> None:
        """One-sided: keep the blocks of a released reservation for a while, so that a
        write for it whose bytes land after all is reported (Overwritten) naming them."""
        if not self.one_sided:
            return
        until = r.deadline + 2 * self.config.cancel_grace_s + self.config.timeout_s
        self._released[(req, r.epoch)] = (tuple(sorted(r.blocks)), r.deadline, until)
        self._released.move_to_end((req, r.epoch))
        while len(self._released) > MAX_RELEASED:
            self._released.popitem(last=False)

    def _on_written(self, sender: bytes, msg: dict[str, Any], frames: list[Any]) -> None:
        req, epoch, blocks = msg["req"], msg["epoch"], msg["blocks"]
        r = self._reservations.get(req)
        reason = ""
        if (req, epoch) in self._quarantine:
            reason = "the request was aborted or expired"
            # The cancel may not have reached this sender before: repeat it.
            self._router.send_multipart([sender, encode("cancel", req=req, epoch=epoch,
                                                        deadline=self._quarantine[(req, epoch)].deadline)])
        elif self.one_sided and (req, epoch) in self._released:
            # Its bytes landed in blocks that may be in use again: say which, loudly.
            released, deadline, _ = self._released[(req, epoch)]
            landed = set(released) & (set(blocks) | (_covered(msg["runs"]) or set()))
            reason = "the request's blocks were already released"
            if landed:
                self.stats["overwritten"] += 1
                logger.error("a write from %s for %s/%d landed in blocks %s after they were released: "
                             "their contents are unknown", sender.decode(), req, epoch, sorted(landed)[:16])
                self._events.append(Overwritten(req, epoch, tuple(sorted(landed))))
            self._router.send_multipart([sender, encode("cancel", req=req, epoch=epoch, deadline=deadline)])
        elif r is None:
            reason = "no reservation for this request"
        elif r.epoch != epoch:
            reason = f"epoch {epoch} is stale (reserved: {r.epoch})"
        elif not set(blocks) <= r.blocks:
            reason = f"blocks {sorted(set(blocks) - r.blocks)[:5]} were not reserved for it"
        elif time.time() > r.deadline:
            reason = "the reservation's deadline passed"
        elif _covered(msg["runs"]) != set(blocks):
            reason = "its runs do not cover exactly its blocks"
        if not reason and not self.one_sided:
            try:
                self._apply(sender.decode(), msg["xfer"], msg["runs"], frames)
            except (ValueError, RuntimeError) as exc:
                reason = f"unusable data: {exc}"
        elif reason and not self.one_sided and _covered(msg["runs"]) is not None:
            try:
                self._discard(sender.decode(), msg["xfer"], msg["runs"])
            except (ValueError, RuntimeError) as exc:
                logger.warning("could not drain a refused write's data: %s", exc)
        if reason:
            self.stats["late_writes_dropped"] += 1
            logger.warning("dropped a write from %s for %s/%d: %s", sender.decode(), req, epoch, reason)
            self._router.send_multipart([sender, encode("ack", xfer=msg["xfer"], ok=False, reason=reason)])
            return
        if r.sender is None:
            r.sender = sender.decode()
        r.pending -= set(blocks)
        self._events.append(Received(req, epoch, tuple(blocks)))
        self._router.send_multipart([sender, encode("ack", xfer=msg["xfer"], ok=True, reason="")])
        if not r.pending:
            del self._reservations[req]
            self._events.append(Completed(req, epoch))

    # ------------------------------------------------------------------ both

    def poll(self) -> list[Event]:
        """Progress every transfer and return what happened since the last call."""
        self._drain_router()
        for sender, body in self._incoming_notifications():
            self._on_control(sender, body, [])
        for peer in self._peers.values():
            self._drain_dealer(peer)
        now_mono, now = time.monotonic(), time.time()
        stalled: set[str] = set()  # peers still holding the data of writes that timed out
        for w in list(self._writes.values()):
            if not w.notified:
                try:
                    self._notify_when_landed(w)
                except Exception as exc:
                    self._fail(w, f"data plane error: {exc}")
                    continue
            if w.xfer not in self._writes or now_mono - w.started <= self.config.timeout_s:
                continue
            reason = f"no acknowledgement from {w.peer!r} within {self.config.timeout_s} s"
            if w.notified:
                self._fail(w, reason)
                if w.xfer in self._ending and w.peer in self._peers:  # its data is still queued
                    stalled.add(w.peer)
            elif w.failure is None:
                # Its bytes are still moving (a slow or stalled data plane): it fails
                # once they have landed or the data plane reports an error.
                w.failure = reason
        for name in stalled:
            self._reconnect(self._peers[name])
        for req, r in list(self._reservations.items()):
            if now > r.deadline:
                self.stats["expired"] += 1
                del self._reservations[req]
                self._events.append(Expired(req, r.epoch))
                self._kill(req, r)
        for (req, epoch), r in list(self._quarantine.items()):
            if now > r.deadline + self.config.cancel_grace_s:
                self._release(req, epoch)  # the sender refuses to start writes this late
        for key in [k for k, deadline in self._cancelled.items() if now > deadline]:
            del self._cancelled[key]
        for key in [k for k, (*_, until) in self._released.items() if now > until]:
            del self._released[key]
        for w, event in list(self._ending.values()):
            self._end(w, event)  # reported now if the data plane let go of its source
        for key, peer in list(self._acks_due.items()):
            if not any((w.req, w.epoch) == key for w in self._writes.values() if not w.notified):
                del self._acks_due[key]
                peer.socket.send(encode("cancel_ack", req=key[0], epoch=key[1]))
        events, self._events = self._events, []
        return events

    def _drain_router(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_control(frames[0].bytes, frames[1].bytes, frames[2:])

    def _on_control(self, sender: bytes, body: bytes, data: list[Any]) -> None:
        """A message to us as receiver: a write's notification, or a cancel_ack."""
        try:
            msg = decode(body)
        except MessageError as exc:
            logger.warning("dropped a control message from %r: %s", sender, exc)
            return
        if msg["kind"] == "written":
            self._on_written(sender, msg, data)
        elif msg["kind"] == "cancel_ack":
            self._release(msg["req"], msg["epoch"])
        elif msg["kind"] == "join":
            self._on_join(sender.decode(), msg["session"])

    def _drain_dealer(self, peer: _Peer) -> None:
        while True:
            try:
                body = peer.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(body)
            except MessageError as exc:
                logger.warning("dropped a control message from %r: %s", peer.name, exc)
                continue
            if msg["kind"] == "ack":
                w = self._writes.pop(msg["xfer"], None)
                if w is None:
                    continue
                if msg["ok"]:
                    self._end(w, WriteDone(w.xfer, w.peer, w.req, w.epoch))
                else:
                    self._writes[w.xfer] = w
                    self._fail(w, f"refused by {peer.name!r}: {msg['reason']}")
            elif msg["kind"] == "cancel":
                self._on_cancel(peer, msg["req"], msg["epoch"], msg["deadline"])

    def _on_cancel(self, peer: _Peer, req: str, epoch: int, deadline: float) -> None:
        """Refuse (req, epoch) from now on; confirm once none of its bytes can still land
        (poll sends the cancel_ack when its moving writes have landed)."""
        self._cancelled[(req, epoch)] = deadline
        for w in list(self._writes.values()):
            if (w.req, w.epoch) == (req, epoch):
                self._cancel_write(w)
        self._acks_due[(req, epoch)] = peer

    def close(self) -> None:
        try:
            self._close()
        finally:  # the sockets go even if the data plane's cleanup failed
            for peer in self._peers.values():
                peer.socket.close(0)
            self._router.close(0)
            self._ctx.term()
