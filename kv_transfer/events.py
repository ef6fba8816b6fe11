"""What KVTransport.poll() reports: the outcome of each write on the sender (P), and
what happened to each reservation on the receiver (D). Plain frozen records."""

from __future__ import annotations

from dataclasses import dataclass


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
class Overwritten:  # D: a one-sided write of a reservation D had given up on landed after all
    req: str  # the dead reservation's request and epoch
    epoch: int
    blocks: tuple[int, ...]  # the blocks it landed in: their contents are unknown now
    # True: they were still fenced (out of use: harmless). False: already released,
    # maybe in use (the alarm: a transport broke the fence).
    fenced: bool = False


Event = WriteDone | WriteFailed | Received | Completed | Expired | Released | Overwritten
