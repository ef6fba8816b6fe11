"""The KV transports' control messages, between a sender P and a receiver D on the
transport's own ZMQ sockets (kv_transfer/control.py): typed, versioned and checked as
every message is (protocol/wire.py), under the one PROTOCOL_VERSION. Each transport's
handshake metadata carries that version too, so add_peer refuses a peer of another
one before any message is sent (kv_transfer/control.py).

    P -> D   Hello (once per connection), Join (nccl: once per connection), Written
    D -> P   Ack (per Written), Cancel
    P -> D   CancelAck

kv_transfer/sender.py and kv_transfer/receiver.py say what each one means.
"""

from __future__ import annotations

from protocol.wire import Codec, Message

Run = tuple[int, int]  # [dst_start, count]: consecutive blocks of the receiver
# [dst_rank, dst_head, num_heads, whole]: the heads of one receiving rank a write's data
# carries (kv_transfer/rank_pairs.py wire()), whole 1 when that is every head of the rank.
Piece = tuple[int, int, int, int]
Layers = tuple[int, int]  # [start, end) of the model's layers


class Written(Message, frozen=True, tag="written"):
    """Blocks `blocks` of reservation (req, epoch) hold the data now (one-sided
    transports), or it follows in this message's data frames (two-sided: tcp, nccl)."""

    xfer: int  # the sender's write id, echoed in the Ack
    req: str
    epoch: int
    blocks: list[int]  # the receiver's blocks written
    runs: list[Run]
    pieces: list[Piece]  # in the order of the data frames
    # Layers [start, end) of those blocks (stream: layer); None: every layer. The
    # receiver counts a block in only once every layer of it has come.
    layers: Layers | None = None


class Ack(Message, frozen=True, tag="ack"):
    """The write `xfer` was applied (ok) or refused (reason)."""

    xfer: int
    ok: bool
    reason: str  # "" when ok


class Cancel(Message, frozen=True, tag="cancel"):
    """Stop writing (req, epoch); reply CancelAck once no write of it can land any more."""

    req: str
    epoch: int
    deadline: float  # the reservation's (time.time()): the sender forgets the cancel then


class CancelAck(Message, frozen=True, tag="cancel_ack"):
    req: str
    epoch: int
    session: str  # the sender's KVTransport.session: an ack from a restarted sender is no proof


class Hello(Message, frozen=True, tag="hello"):
    """Who is writing, so that the receiver can tell when that process can no longer
    write (kv_transfer/liveness.py ProcessId)."""

    session: str
    pid: int
    start: int  # the process's start time, in clock ticks since boot
    boot: str  # the host's boot id
    pidns: int  # its pid namespace's inode


class Join(Message, frozen=True, tag="join"):
    """Set up the data plane's pairwise channel (nccl). `session` is new each time the
    sender connects, so a restarted peer (same name) rendezvouses afresh."""

    session: str


KV_CONTROL_MESSAGES = Codec(Written, Ack, Cancel, CancelAck, Hello, Join)
