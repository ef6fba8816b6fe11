"""The KV transports' control messages (P <-> D, on their own sockets): versioned
msgpack, never pickle.

Every message is a map with "v" (the schema's version) and "kind", and exactly the
fields listed for its kind, with the listed types. decode() refuses anything else
with a MessageError naming what is wrong, so a bad peer cannot crash or confuse us.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

_INT, _STR, _LIST, _BOOL, _BYTES, _FLOAT, _DICT = int, str, list, bool, bytes, (int, float), dict


class MessageError(ValueError):
    """A message that is not one of ours."""


class ListOf:
    """A field that is a list whose every item passes `accepts` (a bool is no int)."""

    def __init__(self, accepts: Callable[[Any], bool]) -> None:
        self.accepts = accepts

    def check(self, value: Any) -> bool:
        return isinstance(value, list) and all(self.accepts(v) for v in value)


def _is_int(value: Any) -> bool:
    return type(value) is int


_INTS = ListOf(_is_int)
_INT_PAIRS = ListOf(lambda v: isinstance(v, list) and len(v) == 2 and all(map(_is_int, v)))
_INT_QUADS = ListOf(lambda v: isinstance(v, list) and len(v) == 4 and all(map(_is_int, v)))

FieldType = type | tuple[type, ...] | ListOf


class Schema:
    def __init__(self, version: int, fields: dict[str, dict[str, FieldType]]) -> None:
        self.version = version
        self.fields = fields

    def encode(self, kind: str, **fields: Any) -> bytes:
        spec = self.fields[kind]
        if set(fields) != set(spec):
            raise MessageError(f"{kind}: fields {sorted(fields)}, expected {sorted(spec)}")
        return msgpack.packb({"v": self.version, "kind": kind, **fields}, use_bin_type=True)

    def decode(self, data: bytes) -> dict[str, Any]:
        try:
            msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several types for garbage
            raise MessageError(f"undecodable message: {exc}") from None
        if not isinstance(msg, dict):
            raise MessageError(f"a message must be a map, got {type(msg).__name__}")
        if msg.get("v") != self.version:
            raise MessageError(f"message version {msg.get('v')!r}, this side speaks {self.version}")
        kind = msg.get("kind")
        if kind not in self.fields:
            raise MessageError(f"unknown message kind {kind!r}")
        for name, typ in self.fields[kind].items():
            value = msg.get(name)
            if isinstance(typ, ListOf):
                ok = typ.check(value)
            else:
                ok = isinstance(value, typ) and not (isinstance(value, bool) and typ is not _BOOL)
            if not ok:
                raise MessageError(f"{kind}.{name} has the wrong type: {str(value)[:200]}")
        return msg


# Version 2: cancel carries the reservation's deadline (the sender forgets it then).
# Version 3: written carries its pieces (writes between TP sizes).
# Version 4: hello (the sender's process, for the receiver's fence: liveness.py), and
# cancel_ack names the sender's session (an ack from a restarted sender is no proof).
CONTROL = Schema(4, {
    # sender -> receiver: blocks [dst...] of (request, epoch) hold the data now (for
    # one-sided transports), or follow in this message's data frames (two-sided).
    # runs: [dst_start, count]; pieces: [dst_rank, dst_head, num_heads, whole], the heads
    # of each receiving rank written (rank_pairs.wire), in the order of the data frames.
    "written": {"xfer": _INT, "req": _STR, "epoch": _INT, "blocks": _INTS, "runs": _INT_PAIRS,
                "pieces": _INT_QUADS},
    # receiver -> sender: the write `xfer` was applied (ok) or refused (reason).
    "ack": {"xfer": _INT, "ok": _BOOL, "reason": _STR},
    # receiver -> sender: stop writing (request, epoch); reply cancel_ack once no write
    # of it can land any more.
    "cancel": {"req": _STR, "epoch": _INT, "deadline": _FLOAT},
    "cancel_ack": {"req": _STR, "epoch": _INT, "session": _STR},
    # sender -> receiver, once per connection (add_peer): who is writing, so that the
    # receiver can tell when that process can no longer write (liveness.ProcessId).
    "hello": {"session": _STR, "pid": _INT, "start": _INT, "boot": _STR, "pidns": _INT},
    # sender -> receiver, once per connection: set up the data plane's pairwise
    # channel (nccl). `session` is new each time the sender connects, so a restarted
    # peer (same name) rendezvouses afresh.
    "join": {"session": _STR},
})
encode, decode = CONTROL.encode, CONTROL.decode
