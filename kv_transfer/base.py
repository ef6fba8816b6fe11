"""The KV transport interface: who calls what, and the hooks a transport implements.

Who calls what, and when (P = prefill worker, the sender; D = decode worker, the receiver):

    both    t = create_transport(name, agent_name, config)
            cache = t.allocate_kv_cache(shape, dtype, device)  # where peers can reach it
            t.register_kv_cache(cache, model)                   # once, before metadata()
                # a TP worker's driver instead registers every rank's cache:
                # t.register_kv_cache(caches, model, num_kv_heads, head_ranges, files)
            blob = t.metadata()      # bytes: handed to peers over the caller's own channel
    D       t.expect(req, epoch, blocks, deadline)  # before telling P those blocks
    P       peer = t.add_peer(blob_of_D)            # refused, naming the field, if incompatible
            xfer = t.write(peer, req, epoch, src_blocks, dst_blocks, deadline, layers=None)
                     # every rank pair's heads (rank_pairs.py); block ids hold on every rank
                     # layers (start, end): only those layers of the blocks (stream: layer);
                     # D counts a block in once every layer of it has come
                     # the source blocks must stay unchanged until the write is done or failed
            t.cancel(req)                           # stop writing it (e.g. the request died)
    both    events = t.poll()                       # never blocks; call every step
                     # D: Overwritten means blocks it reused hold a late write's bytes
    D       t.abort(req)                            # the request died or fell back to local
    both    t.close()

KVTransport composes three parts, each with its own rules in its docstring:
control.py (sockets, peers, handshake, messages), sender.py (P: a write's lifecycle,
its deadline, timeouts and cancels) and receiver.py (D: reservations, quarantine,
Overwritten; and which message owns cancellation). A transport subclass moves the
bytes: it implements the hooks below and nothing else.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from kv_transfer import liveness
from kv_transfer.compat import IncompatiblePeerError, KVCompat
from kv_transfer.config import TransportConfig
from kv_transfer.control import ControlPlane, Peer
from kv_transfer.events import Event
from kv_transfer.rank_pairs import HeadRange, plan
from kv_transfer.receiver import ReceiverState
from kv_transfer.sender import SenderState, Write, written_message
from protocol import Message, encode
from protocol.kv_control import Ack, Cancel, CancelAck, Hello, Join, Layers, Piece, Run, Written


class KVTransport(ABC):
    """Base class: the public API, composed of the control plane, the sender's and the
    receiver's state. Subclasses move the bytes: see the hooks below."""

    name = "base"
    one_sided = False  # True: bytes land without the receiver's involvement
    multi_rank = False  # True: registers a TP>1 worker's rank caches and moves heads between TP sizes
    fabric = "host"  # the wire its KV crosses between hosts (kv_transfer/fabric.py)
    # The most bytes one descriptor may carry (None: a whole run of consecutive blocks).
    max_run_bytes: int | None = None
    # True: a layer range of a run is gathered into one buffer (a frame, a send), so it
    # moves as one descriptor, like the whole run; False: one per block and head.
    gathers_layers = False
    # A CUDA cache: True when the data plane reads it only after the work queued on the
    # caller's current stream (a copy on a stream that waits for it, a staging copy, a
    # collective), so a layer's write may be posted as soon as the layer is queued.
    stream_ordered = True

    def __init__(self, agent_name: str, config: TransportConfig | None = None) -> None:
        self.agent_name = agent_name
        self.config = config or TransportConfig()
        self.kv_cache: torch.Tensor | None = None  # rank 0's (the only one at TP 1)
        self.kv_caches: list[torch.Tensor] = []  # every rank's, as this process maps them
        self.compat: KVCompat | None = None
        self.control = ControlPlane(agent_name, self.config.host, self.config.secret)
        self.session = self.control.session  # new per transport object (control.py)
        self.control_address = self.control.address
        self._events: list[Event] = []  # appended to by both parts, handed out by poll()
        self.stats: dict[str, int] = dict(writes=0, writes_done=0, writes_failed=0, bytes_written=0,
                                          descriptors=0, late_writes_dropped=0, expired=0, overwritten=0,
                                          overwritten_in_use=0, regions=0)
        self.sending = SenderState(self, self.control, self.config.timeout_s, self._events, self.stats)
        self.receiving = ReceiverState(self, self.control, self.config.timeout_s, self.config.cancel_grace_s,
                                       self._events, self.stats)

    # ------------------------------------------------------------------ subclass hooks

    def allocate_kv_cache(self, shape: Sequence[int], dtype: torch.dtype, device: str) -> torch.Tensor:
        """Memory for the local cache that peers of this transport can reach."""
        return torch.zeros(tuple(shape), dtype=dtype, device=device)

    @abstractmethod
    def _register(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        """Register the cache with the data plane; returns what peers need (msgpack-able)."""

    @abstractmethod
    def _connect(self, peer: Peer) -> None:
        """Prepare to write into `peer` (its data-plane metadata is peer.data)."""

    @abstractmethod
    def _start(self, peer: Peer, write: Write) -> None:
        """Begin moving write.runs (src_start, dst_start, count) into the peer's cache.

        Two-sided transports send the data with the notification instead: they
        implement _data_frames and leave this empty."""

    def _progress(self, write: Write) -> bool:
        """One-sided: True once the bytes have landed (raise on a data-plane error)."""
        return True

    def _source_in_use(self, write: Write) -> bool:
        """True while the data plane may still read the write's source blocks after its
        outcome is known (tcp: its frames, sent zero-copy, are still queued in ZMQ; shm: its
        copy still runs when the peer is declared gone). Its WriteDone / WriteFailed, on
        which the caller reuses those blocks, waits until this is False. Must not block."""
        return False

    def _data_frames(self, write: Write) -> list[Any]:
        """Two-sided: the data sent with the notification, one frame per run."""
        return []

    def _send_notification(self, peer: Peer, write: Write) -> None:
        """Tell the receiver the write has landed. Transports whose data plane delivers
        a notification after the data (NIXL) attach _header(write) there instead."""
        peer.socket.send_multipart([self._header(write), *self._data_frames(write)], copy=False)

    @staticmethod
    def _header(write: Write) -> bytes:
        """The write's "written" notification (sender.py)."""
        return written_message(write)

    def _incoming_notifications(self) -> list[tuple[bytes, bytes]]:
        """(sender agent name, "written" message) pairs from the data plane, if it has any."""
        return []

    def _abandon(self, write: Write) -> None:
        """Free the data plane's resources of a write that failed or timed out."""

    def _apply(self, sender: str, xfer: int, runs: Sequence[Run], pieces: Sequence[Piece],
               frames: list[Any], layers: Layers | None) -> None:
        """Two-sided, on D: put write `xfer`'s data into the local caches (runs: dst_start,
        count; pieces: rank_pairs.wire, checked to fill every local head; layers: the
        layer range, checked, None for every layer); `frames` are whatever came with the
        notification."""
        raise NotImplementedError

    def _discard(self, sender: str, xfer: int, runs: Sequence[Run], layers: Layers | None) -> None:
        """Two-sided, on D: consume and drop the data of a refused write, if it comes
        separately from the notification."""

    def _on_join(self, sender: str, session: str) -> None:
        """On D: a sender asked to set up a pairwise data channel (`session`: new for
        each of its connections)."""

    def _warm(self, peer: Peer) -> None:
        """Make whatever _connect() left to the first write (connections, groups)."""

    def _disconnect(self, name: str) -> None:
        """Free what _connect() (as sender) or _on_join() (as receiver) set up for a
        peer that is gone. It is dead: nothing here may wait for it."""

    def _close(self) -> None:
        pass

    # ------------------------------------------------------------------ setup

    @property
    def registered_cache(self) -> torch.Tensor:
        """kv_cache, for the data planes: each runs only once register_kv_cache() set it."""
        if self.kv_cache is None:
            raise RuntimeError("register_kv_cache() first")
        return self.kv_cache

    @property
    def registered_compat(self) -> KVCompat:
        """compat, for what runs only once register_kv_cache() set it (handshakes, writes)."""
        if self.compat is None:
            raise RuntimeError("register_kv_cache() first")
        return self.compat

    def register_kv_cache(self, caches: torch.Tensor | Sequence[torch.Tensor], model: str,
                          num_kv_heads: int | None = None, head_ranges: Sequence[HeadRange] | None = None,
                          files: Sequence[str] | None = None,
                          kv_scales: Sequence[tuple[float, float]] = ()) -> None:
        """Register the worker's KV cache, once, before metadata().

        caches: the cache (TP 1), or one per TP rank, as this process (the worker's
        driver) sees them. head_ranges[r]: the model's KV heads [start, end) that rank r
        holds (rank_pairs.even_head_ranges is the engine's split); num_kv_heads: the
        model's count. Both default, at TP 1 only, to every head of the one cache.
        files: where each rank's cache lives under /dev/shm, for transports whose peers
        map it (shm; the others ignore it). kv_scales: an fp8 cache's per-layer
        (k_scale, v_scale), which a peer must share (compat.py)."""
        if self.kv_cache is not None:
            raise RuntimeError("a KV cache is already registered with this transport")
        ranks = [caches] if isinstance(caches, torch.Tensor) else list(caches)
        if len(ranks) > 1 and not self.multi_rank:
            raise ValueError(f"the {self.name} transport cannot register {len(ranks)} rank caches: KV transfers "
                             f"between TP>1 workers are not built for {self.name} yet (they need a transfer "
                             "agent per rank, on its GPU); use shm or tcp, or TP 1")
        if num_kv_heads is None or head_ranges is None:
            if len(ranks) != 1:
                raise ValueError(f"{len(ranks)} rank caches: say num_kv_heads and each rank's head_ranges")
            heads = ranks[0].shape[1] if isinstance(ranks[0], torch.Tensor) and ranks[0].dim() == 6 else 0
            num_kv_heads = heads if num_kv_heads is None else num_kv_heads
            head_ranges = [(0, heads)] if head_ranges is None else head_ranges
        if files is not None and (len(files) != len(ranks) or not all(isinstance(f, str) for f in files)):
            raise ValueError(f"{len(ranks)} rank caches need as many file paths, got {files!r}")
        self.compat = KVCompat.from_caches(ranks, model, num_kv_heads, head_ranges, kv_scales)
        self.kv_caches = ranks
        self.kv_cache = ranks[0]
        # Each rank's cache as [blocks, bytes]: what the data planes move.
        self._rank_bytes = [c.view(torch.uint8).view(c.shape[0], -1) for c in ranks]
        self._blocks_bytes = self._rank_bytes[0]
        # ... and as [blocks, heads, layers, bytes]: what a write of a layer range moves.
        self._rank_layers = [b.view(b.shape[0], heads, self.compat.num_layers, -1)
                             for b, heads in zip(self._rank_bytes, self.compat.local_heads)]
        self._files = list(files) if files is not None else None
        try:
            self._data_meta = self._register(self.kv_cache)
        except BaseException:
            self.kv_cache = self.compat = None
            raise

    def refused_peers(self) -> int:
        """Peers refused so far (without the deployment's secret) by this transport's
        sockets: its control socket, and any its data plane adds."""
        return self.control.refused

    def metadata(self) -> bytes:
        """The handshake blob for peers: who we are, where we listen, what we hold."""
        return self.control.handshake(self.name, self.registered_compat, self.registered_cache.shape[0],
                                      self._data_meta)

    def add_peer(self, metadata: bytes) -> str:
        """Connect to a receiver from its metadata(); returns its agent name."""
        if self.compat is None:
            raise RuntimeError("register_kv_cache() first")
        name, compat, meta = self.control.read_handshake(metadata, self.name, self.compat)
        if compat.tp_size > 1 and not self.multi_rank:
            raise IncompatiblePeerError(f"peer {name!r} is at TP {compat.tp_size}: the {self.name} transport "
                                        "does not move KV between TP>1 workers yet")
        known = self.control.peers.get(name)
        if known is not None:
            if known.metadata == metadata:
                return name
            # Same agent name, new metadata: the peer was restarted (new process, new
            # cache and control socket). The old one is dead.
            self.peer_gone(name)
        peer = self.control.open(name, compat, meta, metadata, plan(self.compat.head_ranges, compat.head_ranges))
        try:
            self._connect(peer)
        except BaseException:  # refused or failed: no peer, so its control socket goes too
            peer.socket.close(0)
            raise
        self.control.peers[name] = peer
        # Who we are, for the receiver's fence: it keeps the blocks of a reservation it
        # gave up on out of use until we confirm (cancel_ack) or this process is gone.
        me = liveness.this_process()
        peer.socket.send(encode(Hello(session=self.session, pid=me.pid, start=me.start, boot=me.boot,
                                      pidns=me.pidns)))
        return name

    def warm_up(self, name: str) -> None:
        """Finish the handshake with peer `name` now rather than on the first write (the
        receiver must be polling meanwhile). Raises if it cannot be made."""
        self._warm(self.control.peers[name])

    def peer_session(self, name: str) -> str | None:
        """The session of the agent `name` we write to now (None: not a peer). A write
        meant for another session of it (one that died) must not start."""
        peer = self.control.peers.get(name)
        return peer.session if peer is not None else None

    def peer_gone(self, name: str) -> None:
        """The process of agent `name` is gone (its supervisor says so). As sender: our
        writes to it fail now (reported once the data plane no longer reads their source
        blocks: at once, or at a later poll), and it is forgotten (add_peer it again once
        restarted). As receiver: its live reservations die (Expired) and every
        reservation it was writing is Released once it can no longer write: at once if
        its process has exited or cannot be checked from here (receiver.py)."""
        # First the socket (linger 0): it drops the frames still queued for the peer
        # (tcp sends them from the cache, zero-copy), so that ZMQ lets go of our source
        # blocks at once and the writes can fail (they do once it has: _source_in_use).
        peer = self.control.drop(name)
        if peer is not None:
            self.sending.peer_gone(peer)
        self._disconnect(name)
        self.receiving.peer_gone(name)

    # ------------------------------------------------------------------ sender (P)

    def write(self, peer: str, req: str, epoch: int, src_blocks: Sequence[int],
              dst_blocks: Sequence[int], deadline: float, layers: Layers | None = None) -> int:
        """Start writing local src_blocks into the peer's dst_blocks; returns the xfer id.
        layers (start, end): only those layers of the blocks (None: every layer).

        The outcome arrives as WriteDone or WriteFailed from poll(). Refused at once
        (as WriteFailed) after the deadline or a cancel for (req, epoch)."""
        return self.sending.write(peer, req, epoch, src_blocks, dst_blocks, deadline, layers)

    def cancel(self, req: str) -> None:
        """Stop writing `req`: writes whose notification has not gone out fail (once
        their bytes, if moving, have landed); nothing new starts for it."""
        self.sending.cancel(req)

    # ------------------------------------------------------------------ receiver (D)

    def expect(self, req: str, epoch: int, blocks: Sequence[int], deadline: float,
               sender: str | None = None, layer_masks: Sequence[int] | None = None) -> None:
        """Reserve `blocks` for writes of (req, epoch) until `deadline` (time.time()).

        `sender`: the agent name of the one sender that may write it. A dead one-sided
        reservation's blocks stay fenced until that sender confirms (cancel_ack) or has
        exited; unnamed (and no write came yet), until every sender that said hello has
        (receiver.py). The decode worker always names it. `layer_masks`: per block, a
        bit per layer that will be written (the rest are never read); None: every layer."""
        self.receiving.expect(req, epoch, blocks, deadline, sender, layer_masks)

    def holds_reservations(self) -> bool:
        """D: some reserved blocks are not back yet: live reservations, or dead ones
        waiting for Released (the sender's cancel_ack, or its exit)."""
        return self.receiving.holds()

    def abort(self, req: str) -> None:
        """Drop the reservation; Released follows once its blocks are safe to reuse."""
        self.receiving.abort(req)

    def unwritten(self, req: str, epoch: int, sender: str) -> None:
        """D: `sender` refused reservation (req, epoch) before writing anything (it said
        so over the worker plane): its blocks need no cancel_ack from it."""
        self.receiving.unwritten(req, epoch, sender)

    def quarantined_blocks(self) -> int:
        """D: blocks of dead reservations not yet Released (a write may still land)."""
        return self.receiving.quarantined_blocks()

    # ------------------------------------------------------------------ both

    def poll(self) -> list[Event]:
        """Progress every transfer and return what happened since the last call."""
        for sender, msg, frames in self.control.incoming():
            self._on_message(sender, msg, frames)
        for sender, body in self._incoming_notifications():
            notified = self.control.decode(sender, body)
            if notified is not None:
                self._on_message(sender, notified, [])
        for peer in self.control.peers.values():
            for msg in self.control.replies(peer):
                if isinstance(msg, Ack):
                    self.sending.on_ack(peer, msg.xfer, msg.ok, msg.reason)
                elif isinstance(msg, Cancel):
                    self.sending.on_cancel(peer, msg.req, msg.epoch, msg.deadline)
        now_mono, now = time.monotonic(), time.time()
        self.sending.advance(now_mono)
        self.receiving.expire(now)
        self.sending.settle(now)
        events = list(self._events)
        self._events.clear()
        return events

    def _on_message(self, sender: bytes, msg: Message, data: list[Any]) -> None:
        """A message to us as receiver: a write's notification, a cancel_ack, a hello, a join."""
        if isinstance(msg, Written):
            self.receiving.on_written(sender, msg, data)
        elif isinstance(msg, CancelAck):
            self.receiving.on_cancel_ack(sender.decode(), msg.req, msg.epoch, msg.session)
        elif isinstance(msg, Hello):
            self.receiving.on_hello(sender.decode(), msg.session, liveness.ProcessId(
                msg.pid, msg.start, msg.boot, msg.pidns))
        elif isinstance(msg, Join):
            self._on_join(sender.decode(), msg.session)

    def close(self) -> None:
        try:
            self._close()
        finally:  # the sockets go even if the data plane's cleanup failed
            self.control.close()
