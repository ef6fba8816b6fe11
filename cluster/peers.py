"""The Peers message each worker gets from its launcher (protocol/control.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from protocol import Peers, encode


class _Started(Protocol):
    name: str
    address: str  # its ZMQ address, from its Ready message
    metadata: bytes  # its transport metadata, from its Ready message
    draining: bool  # being scaled down (cluster/elastic.py)


def peers_messages(decode_workers: Sequence[_Started], prefill_workers: Sequence[_Started]) -> tuple[bytes, bytes]:
    """The Peers message for every decode worker and for every prefill worker: decode
    workers connect to the prefill workers' ZMQ addresses and send no new prompt to a
    draining one; prefill workers add the decode workers' transports as KV
    destinations (a draining decode worker's too: its requests still take KV)."""
    prefill = {w.name: w.address for w in prefill_workers}
    draining = sorted(w.name for w in prefill_workers if w.draining)
    return (encode(Peers(prefill=prefill, draining=draining)),
            encode(Peers(decode=[w.metadata for w in decode_workers])))
