"""The sender's (P's) side of a transport: writes in flight, their lifecycle and
deadlines, cancels, and the notification that tells the receiver a write has landed.

A write is one request's list of blocks and carries one notification (request id and
epoch). Between workers of one TP size with the same head split it moves as one
descriptor per run of consecutive blocks per rank pair (block-major layout: a block of
every layer is one region); between TP sizes, each rank pair moves the heads the
receiving rank owns, one descriptor per block (rank_pairs.py). Its life:

    write()  -> the data plane moves the runs (_start)
             -> they have landed (_progress): the "written" notification goes out
             -> D's ack: WriteDone; D's refusal: WriteFailed
    no ack within timeout_s of write(), a cancel, or a data-plane error: WriteFailed

A dead peer is an error within `timeout_s`, never a hang. A write whose bytes are still
moving when it is cancelled or times out fails once they have landed (or the data
plane reports an error), never before: until its WriteFailed, P must not reuse its
source blocks, and P's cancel_ack, which lets D reuse the destination blocks, waits for
it too. Likewise no write is reported done or failed while its data plane still reads
its source blocks (`_source_in_use`): tcp sends them zero-copy, so a write whose frames
ZMQ still holds (queued for a peer that does not read, or is dead: ZMQ keeps them for a
reconnection) ends only once ZMQ lets go of them. When such a write times out, or
peer_gone() is called, the control socket to that peer is closed (linger 0, and
replaced unless the peer is gone), which drops them; the write fails at a later poll.

P starts no write after its reservation's deadline, nor for a (request, epoch) that
was cancelled, which it remembers until that deadline. Who cancels what, and which
message frees the blocks: receiver.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kv_transfer.compat import KVCompat
from kv_transfer.control import ControlPlane, Peer
from kv_transfer.events import Event, WriteDone, WriteFailed
from kv_transfer.rank_pairs import Piece, count_descriptors, heads_moved, wire
from kv_transfer.reservation import check_layers
from kv_transfer.runs import coalesce
from protocol import encode
from protocol.kv_control import CancelAck, Layers, Written

logger = logging.getLogger(__name__)


@dataclass
class Write:
    """One write in flight, as the data-plane hooks get it."""

    xfer: int
    peer: str
    req: str
    epoch: int
    dst: list[int]
    runs: list[tuple[int, int, int]]  # (src_start, dst_start, count)
    pieces: list[Piece]  # which heads go from which rank to which (the peer's plan)
    started: float  # time.monotonic() at write()
    deadline: float  # the reservation's (time.time())
    layers: Layers | None = None  # [start, end) of the model's layers (stream: layer); None: every layer
    handle: Any = None  # the data plane's handle while it moves bytes (tcp: its frames' ZMQ tracker)
    notified: bool = False  # the "written" message went out; waiting for the ack
    # Cancelled or timed out while its bytes were moving: it fails (with this reason)
    # once they have landed, never before (see SenderState.notify_when_landed).
    failure: str | None = None


def written_message(w: Write) -> bytes:
    """The write's notification: after its bytes (one-sided), or ahead of them."""
    return encode(Written(xfer=w.xfer, req=w.req, epoch=w.epoch, blocks=w.dst, runs=[(d, n) for _, d, n in w.runs],
                          pieces=wire(w.pieces), layers=w.layers))


class SenderPlane(Protocol):
    """What the sender needs of its transport: the data-plane hooks base.py declares."""

    one_sided: bool
    gathers_layers: bool
    max_run_bytes: int | None

    @property
    def registered_cache(self) -> torch.Tensor: ...
    @property
    def registered_compat(self) -> KVCompat: ...

    def _start(self, peer: Peer, write: Write) -> None: ...
    def _progress(self, write: Write) -> bool: ...
    def _source_in_use(self, write: Write) -> bool: ...
    def _send_notification(self, peer: Peer, write: Write) -> None: ...
    def _header(self, write: Write) -> bytes: ...
    def _abandon(self, write: Write) -> None: ...


class SenderState:
    """Every write of one transport object, from write() to its WriteDone / WriteFailed."""

    def __init__(self, plane: SenderPlane, control: ControlPlane, timeout_s: float, events: list[Event],
                 stats: dict[str, int]) -> None:
        self._plane = plane
        self._control = control
        self._timeout_s = timeout_s
        self._events = events  # shared with the transport, which hands them out in poll()
        self._stats = stats
        self.writes: dict[int, Write] = {}
        # (req, epoch) never to be written -> its reservation's deadline, after which
        # write() refuses it anyway (so the entry can go).
        self.cancelled: dict[tuple[str, int], float] = {}
        self._acks_due: dict[tuple[str, int], Peer] = {}  # cancels to confirm once landed
        # Writes that ended (the event to report) while the data plane still reads their
        # source blocks (_source_in_use): reported once it no longer does.
        self._ending: dict[int, tuple[Write, WriteDone | WriteFailed]] = {}
        self._xfer_ids = itertools.count(1)

    def write(self, peer: str, req: str, epoch: int, src_blocks: Sequence[int], dst_blocks: Sequence[int],
              deadline: float, layers: Layers | None = None) -> int:
        """KVTransport.write: start one write, or fail it at once; returns its xfer id."""
        target = self._control.peers.get(peer)
        if target is None:
            raise ValueError(f"unknown peer {peer!r}; add_peer() it first")
        num_blocks = self._plane.registered_cache.shape[0]
        peer_blocks = target.data["num_blocks"]
        for name, blocks, limit in (("source", src_blocks, num_blocks), ("destination", dst_blocks, peer_blocks)):
            bad = [b for b in blocks if not (isinstance(b, int) and 0 <= b < limit)]
            if bad:
                raise ValueError(f"{name} block ids out of range [0, {limit}): {bad[:5]}")
        if not src_blocks:
            raise ValueError("a write needs at least one block")
        compat = self._plane.registered_compat
        if problem := check_layers(layers, compat.num_layers):
            raise ValueError(problem)
        if layers is not None:
            layers = None if tuple(layers) == (0, compat.num_layers) else (layers[0], layers[1])
        xfer = next(self._xfer_ids)
        limit = self._plane.max_run_bytes
        block_bytes = compat.block_bytes * (compat.num_layers if layers is None else layers[1] - layers[0]) \
            // compat.num_layers
        max_count = None if limit is None else max(1, limit // block_bytes)
        w = Write(xfer, peer, req, epoch, list(dst_blocks), coalesce(src_blocks, dst_blocks, max_count),
                  target.pieces, time.monotonic(), deadline, layers)
        self.writes[xfer] = w
        self._stats["writes"] += 1
        if (req, epoch) in self.cancelled:
            self.fail(w, "cancelled")
        elif time.time() > deadline:
            self.fail(w, "deadline passed before the write started")
        else:
            try:
                self._plane._start(target, w)
            except Exception as exc:
                self.fail(w, f"data plane error: {exc}")
                return xfer
            self._stats["descriptors"] += count_descriptors(w.pieces, w.runs,
                                                            None if self._plane.gathers_layers else w.layers)
            self._stats["regions"] += len(src_blocks) * heads_moved(w.pieces) * (
                compat.num_layers if w.layers is None else w.layers[1] - w.layers[0])
            try:
                self.notify_when_landed(w)
            except Exception as exc:  # e.g. a copy that already failed (shm: started too late)
                self.fail(w, f"data plane error: {exc}")
        return xfer

    def cancel(self, req: str) -> None:
        """KVTransport.cancel: writes of `req` not yet notified fail once landed."""
        for w in list(self.writes.values()):
            if w.req == req:
                self._cancel_write(w)

    def on_cancel(self, peer: Peer, req: str, epoch: int, deadline: float) -> None:
        """The receiver's cancel: refuse (req, epoch) from now on; confirm once none of
        its bytes can still land (settle() sends the cancel_ack when its moving writes
        have landed)."""
        self.cancelled[(req, epoch)] = deadline
        for w in list(self.writes.values()):
            if (w.req, w.epoch) == (req, epoch):
                self._cancel_write(w)
        self._acks_due[(req, epoch)] = peer

    def on_ack(self, peer: Peer, xfer: int, ok: bool, reason: str) -> None:
        w = self.writes.pop(xfer, None)
        if w is None:
            return
        if ok:
            self._end(w, WriteDone(w.xfer, w.peer, w.req, w.epoch))
        else:
            self.writes[w.xfer] = w
            self.fail(w, f"refused by {peer.name!r}: {reason}")

    def _cancel_write(self, w: Write) -> None:
        self.cancelled[(w.req, w.epoch)] = w.deadline
        if not w.notified:
            w.failure = w.failure or "cancelled"
            self.notify_when_landed(w)

    def notify_when_landed(self, w: Write) -> None:
        """Send the notification of a write whose bytes have landed; or fail it then, if
        it was cancelled or timed out meanwhile. A write fails only once the data plane
        is done with it: its source blocks may be reused, and its destination blocks
        released (cancel_ack), only then."""
        if w.notified:
            return
        try:
            landed = self._plane._progress(w)
        except Exception as exc:  # e.g. a copy that never started (shm: too late): nothing landed
            self.fail(w, f"data plane error: {exc}")
            return
        if not landed:
            return
        if w.failure is not None:
            peer = self._control.peers.get(w.peer)
            if self._plane.one_sided and peer is not None:
                # Its bytes did land: D must hear of them, or it could not tell whether
                # they landed in blocks it has released since (Overwritten). D refuses
                # the write (or accepts it, if its reservation still stands: the bytes
                # are good); either way its ack finds no write here any more.
                peer.socket.send(self._plane._header(w))
            self.fail(w, w.failure)
            return
        self._plane._send_notification(self._control.peers[w.peer], w)
        w.notified = True

    def fail(self, w: Write, reason: str) -> None:
        self.writes.pop(w.xfer, None)
        self._end(w, WriteFailed(w.xfer, w.peer, w.req, w.epoch, reason))

    def _end(self, w: Write, event: WriteDone | WriteFailed) -> None:
        """Report the outcome of a write that left self.writes, once the data plane no
        longer reads its source blocks (the caller reuses them on this event)."""
        if self._plane._source_in_use(w):
            self._ending[w.xfer] = (w, event)
            return
        self._ending.pop(w.xfer, None)
        if isinstance(event, WriteDone):
            self._stats["writes_done"] += 1
            compat = self._plane.registered_compat
            layers = compat.num_layers if w.layers is None else w.layers[1] - w.layers[0]
            self._stats["bytes_written"] += (sum(n for *_, n in w.runs) * heads_moved(w.pieces)
                                             * compat.head_bytes * layers // compat.num_layers)
        else:
            try:
                self._plane._abandon(w)
            except Exception as exc:  # cleanup must not hide the failure being reported
                logger.warning("could not release write %d's data-plane resources: %s", w.xfer, exc)
            self._stats["writes_failed"] += 1
        self._events.append(event)

    def peer_gone(self, peer: Peer) -> None:
        """Its control socket is closed already (ControlPlane.drop): our writes to it
        fail now, reported once the data plane no longer reads their source blocks."""
        for w in [w for w in self.writes.values() if w.peer == peer.name]:
            self.fail(w, f"peer {peer.name!r} is gone")
        self._acks_due = {k: p for k, p in self._acks_due.items() if p is not peer}

    # ------------------------------------------------------------------ each poll

    def advance(self, now_mono: float) -> None:
        """Notify writes that have landed; time out those not acknowledged in time."""
        stalled: set[str] = set()  # peers still holding the data of writes that timed out
        for w in list(self.writes.values()):
            if not w.notified:
                try:
                    self.notify_when_landed(w)
                except Exception as exc:
                    self.fail(w, f"data plane error: {exc}")
                    continue
            if w.xfer not in self.writes or now_mono - w.started <= self._timeout_s:
                continue
            reason = f"no acknowledgement from {w.peer!r} within {self._timeout_s} s"
            if w.notified:
                self.fail(w, reason)
                if w.xfer in self._ending and w.peer in self._control.peers:  # its data is still queued
                    stalled.add(w.peer)
            elif w.failure is None:
                # Its bytes are still moving (a slow or stalled data plane): it fails
                # once they have landed or the data plane reports an error.
                w.failure = reason
        for name in stalled:
            self._control.reconnect(self._control.peers[name])

    def settle(self, now: float) -> None:
        """Forget cancels past their deadline, report writes whose source the data
        plane let go of, and confirm cancels none of whose bytes can land any more."""
        for key in [k for k, deadline in self.cancelled.items() if now > deadline]:
            del self.cancelled[key]
        for w, event in list(self._ending.values()):
            self._end(w, event)  # reported now if the data plane let go of its source
        for key, peer in list(self._acks_due.items()):
            if not any((w.req, w.epoch) == key for w in self.writes.values() if not w.notified):
                del self._acks_due[key]
                peer.socket.send(encode(CancelAck(req=key[0], epoch=key[1], session=self._control.session)))
