"""The messages between a launcher and a worker it started, on their control channel
(workers/control.py): the worker says Ready, takes Peers, says Serving, and then takes
Peers again whenever a peer died, came back, joined, is being drained or left (the
pools grow and shrink at runtime: cluster/elastic.py), until Stop."""

from __future__ import annotations

from protocol.wire import Codec, Message


class Ready(Message, frozen=True, tag="ready"):
    name: str
    address: str  # its ZMQ address
    metadata: bytes  # its KV transport's metadata (KVTransport.metadata())


class Peers(Message, frozen=True, tag="peers"):
    """For a decode worker: the prefill workers' ZMQ addresses by name, and those of
    them being drained (scaled down: they finish the prompts they have but get no new
    one). For a prefill worker: the decode workers' transport metadata (its KV
    destinations)."""

    prefill: dict[str, str] = {}
    draining: list[str] = []
    decode: list[bytes] = []


class Serving(Message, frozen=True, tag="serving"):
    """The first Peers are applied and every KV handshake made (pre-warmed)."""

    cold: list[str] = []  # the peers whose handshake failed


class Stop(Message, frozen=True, tag="stop"):
    """The worker ends (its transport closed)."""


CONTROL_MESSAGES = Codec(Ready, Peers, Serving, Stop)
