"""The control plane: this agent's ZMQ sockets, its peers, and the handshake.

Every agent binds one ROUTER, where messages to it as receiver arrive (a write's
notification, cancel_ack, join), and, as sender, connects one DEALER per peer, whose
routing id is its agent name (acks and cancels come back on it). Messages are
protocol/kv_control.py's, under the protocol's version, which the handshake carries
and add_peer checks; one that does not decode is logged and dropped, never
raised: a bad peer cannot bring this agent down. The control plane knows nothing of
writes or reservations: sender.py and receiver.py say what the messages mean.

With the deployment's secret (TransportConfig.secret) the sockets are CURVE and a
guard admits only peers holding it (security/), and the handshake blob carries a tag
proving it: a blob without a valid one is refused, so no peer can be made to write to
an address an outsider chose. Without one (a transport made alone, in tests) both are
plain.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from kv_transfer.compat import IncompatiblePeerError, KVCompat
from kv_transfer.rank_pairs import Piece
from protocol import PROTOCOL_VERSION, Message, MessageError
from protocol.kv_control import KV_CONTROL_MESSAGES
from security import DeploymentSecret, PlaneGuard, connect_securely, serve_securely

logger = logging.getLogger(__name__)

HANDSHAKE_VERSION = 5  # 2: the blob carries the deployment secret's tag; 3: protocol_version; 4: kv_scales;
# 5: writes may carry a layer range (a peer before it would count a layer's write as the whole block)
TAG = "tag"  # the blob's field holding it


@dataclass
class Peer:
    """A receiver this agent writes to, as add_peer() made it (data-plane hooks get it)."""

    name: str
    compat: KVCompat
    socket: zmq.Socket  # our DEALER to its ROUTER (ControlPlane.reconnect replaces it)
    data: dict[str, Any]  # its data plane's handshake fields, plus num_blocks
    metadata: bytes  # as add_peer() got it: new bytes under the same name = a restart
    session: str  # the peer's KVTransport.session
    control: str = ""  # the address of its control socket
    # What each write to it moves, rank pair by rank pair (rank_pairs.plan of our head
    # ranges and its): at TP 1 on both sides, one whole piece.
    pieces: list[Piece] = field(default_factory=list)


class ControlPlane:
    """The sockets of one transport object, and the peers it writes to (by name)."""

    def __init__(self, agent_name: str, host: str, secret: DeploymentSecret | None = None) -> None:
        self.agent_name = agent_name
        self.secret = secret
        self.ctx = zmq.Context()
        # Before the socket binds: no handshake may come before the guard can answer it.
        self.guard = PlaneGuard(self.ctx, secret, f"{agent_name} (KV control)") if secret is not None else None
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # A restarted sender reconnects under the same identity: it takes over at once.
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if secret is not None:
            serve_securely(self.router, secret)
        # New for every transport object: tells a restarted agent (same name) from the
        # one before it, so no write meant for the old one reaches the new one.
        self.session = uuid.uuid4().hex
        port = self.router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        if self.guard is not None:
            self.guard.watch(self.router)
            self.guard.start()
        self.peers: dict[str, Peer] = {}

    @property
    def refused(self) -> int:
        """Peers refused so far by our control socket (none without a secret)."""
        return self.guard.refused if self.guard is not None else 0

    # ------------------------------------------------------------------ handshake

    def handshake(self, transport: str, compat: KVCompat, num_blocks: int, data: dict[str, Any]) -> bytes:
        """The blob peers need to write to us: who we are, where we listen, what we hold;
        with a secret, last, its tag over the packed map before it."""
        meta = {"v": HANDSHAKE_VERSION, "name": self.agent_name, "transport": transport, "session": self.session,
                "protocol_version": PROTOCOL_VERSION, "control": self.address, "compat": compat.to_dict(),
                "num_blocks": num_blocks, "data": data}
        if self.secret is not None:
            meta[TAG] = self.secret.tag(msgpack.packb(meta, use_bin_type=True))
        return msgpack.packb(meta, use_bin_type=True)

    def read_handshake(self, metadata: bytes, transport: str, compat: KVCompat) -> tuple[str, KVCompat, dict[str, Any]]:
        """A peer's handshake checked against ours: (its name, its compatibility record,
        the whole map). Raises IncompatiblePeerError naming what differs or is missing,
        or, with a secret, that the blob does not prove it."""
        try:
            meta = msgpack.unpackb(metadata, raw=False)
        except Exception as exc:
            raise IncompatiblePeerError(f"unreadable handshake metadata: {exc}") from None
        if not isinstance(meta, dict) or meta.get("v") != HANDSHAKE_VERSION:
            raise IncompatiblePeerError(f"handshake version {meta.get('v') if isinstance(meta, dict) else meta!r}, "
                                        f"this agent speaks {HANDSHAKE_VERSION}")
        self._check_tag(meta)
        missing = [k for k in ("name", "control", "compat", "num_blocks", "data") if k not in meta]
        if missing:
            raise IncompatiblePeerError(f"handshake metadata lacks {', '.join(missing)}")
        name = meta["name"]
        if meta.get("transport") != transport:
            raise IncompatiblePeerError(f"peer {name!r} is incompatible: transport is "
                                        f"{meta.get('transport')!r} there, {transport!r} here")
        if meta.get("protocol_version") != PROTOCOL_VERSION:  # its messages would all be dropped
            raise IncompatiblePeerError(f"peer {name!r} is incompatible: it speaks protocol version "
                                        f"{meta.get('protocol_version')!r}, this side {PROTOCOL_VERSION}")
        peer_compat = KVCompat.from_dict(meta["compat"])
        compat.check_peer(peer_compat, name)
        return name, peer_compat, meta

    def _check_tag(self, meta: dict[str, Any]) -> None:
        """With a secret: the blob's tag must be the secret's over the rest of it, which
        is what handshake() tagged (msgpack packs the same map, in the same order, into
        the same bytes; a blob that packs otherwise is refused, never admitted)."""
        tag = meta.pop(TAG, None)
        who = f"a peer calling itself {meta.get('name')!r}"
        if self.secret is None:
            if tag is not None:  # its sockets are CURVE: ours could never reach it
                raise IncompatiblePeerError(f"{who} holds a deployment secret and this agent none")
            return
        if tag is None:
            raise IncompatiblePeerError(f"{who} is refused: its handshake carries no tag, so it does not prove "
                                        "this deployment's secret")
        if not self.secret.verify(msgpack.packb(meta, use_bin_type=True), tag):
            raise IncompatiblePeerError(f"{who} is refused: its handshake's tag is not this deployment's "
                                        "(another deployment, or a forged or altered blob)")

    def open(self, name: str, compat: KVCompat, meta: dict[str, Any], metadata: bytes,
             pieces: list[Piece]) -> Peer:
        """A Peer with its control socket connected, from read_handshake()'s answer; the
        caller adds it to `peers` once its data plane is connected too."""
        return Peer(name, compat, self._dealer(meta["control"]), dict(meta["data"], num_blocks=meta["num_blocks"]),
                    bytes(metadata), str(meta.get("session", "")), meta["control"], pieces)

    # ------------------------------------------------------------------ sockets

    def _dealer(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, self.agent_name.encode())
        if self.secret is not None:
            connect_securely(sock, self.secret)
        sock.connect(address)
        return sock

    def reconnect(self, peer: Peer) -> None:
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

    def drop(self, name: str) -> Peer | None:
        """Forget peer `name` and close its control socket (linger 0: what is still
        queued for it goes, so ZMQ lets go of any source blocks those frames read)."""
        peer = self.peers.pop(name, None)
        if peer is not None:
            peer.socket.close(0)
        return peer

    def send(self, to: str | bytes, body: bytes) -> None:
        """A message to the sender `to` (its agent name), over our ROUTER."""
        self.router.send_multipart([to.encode() if isinstance(to, str) else to, body])

    # ------------------------------------------------------------------ receiving

    @staticmethod
    def decode(origin: Any, body: bytes) -> Message | None:
        """A control message, or None (logged) if it is not one of ours."""
        try:
            return KV_CONTROL_MESSAGES.decode(body)
        except MessageError as exc:
            logger.warning("dropped a control message from %r: %s", origin, exc)
            return None

    def incoming(self) -> Iterator[tuple[bytes, Message, list[Any]]]:
        """Messages to us as receiver, (sender's agent name, message, the data frames
        that came with it), until none is waiting. Never blocks."""
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            sender = frames[0].bytes
            if sender[:1] == b"\x00" or not _utf8(sender):
                # ZMQ's own name for a connection whose identity a newer one took over
                # (ROUTER_HANDOVER: a restarted sender): what it still delivers is from
                # the process before, and names no agent.
                logger.info("dropped a control message from a replaced connection")
                continue
            msg = self.decode(sender, frames[1].bytes)
            if msg is not None:
                yield sender, msg, frames[2:]

    def replies(self, peer: Peer) -> Iterator[Message]:
        """Messages to us as sender from `peer` (ack, cancel), until none is waiting."""
        while True:
            try:
                body = peer.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.decode(peer.name, body)
            if msg is not None:
                yield msg

    def close(self) -> None:
        for peer in self.peers.values():
            peer.socket.close(0)
        self.router.close(0)
        if self.guard is not None:  # its sockets too, or term() would wait for them
            self.guard.close()
        self.ctx.term()


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
