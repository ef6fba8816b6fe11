"""Control messages between transport agents: versioned msgpack maps, never pickle.

Every message is a map with "v" (VERSION) and "kind", and the fields listed for its
kind in FIELDS with the listed types. decode() refuses anything else with a
MessageError naming what is wrong, so a bad peer cannot crash or confuse an agent.
"""

from __future__ import annotations

from typing import Any

import msgpack

VERSION = 1

_INT, _STR, _LIST, _BOOL, _BYTES = int, str, list, bool, bytes
FIELDS: dict[str, dict[str, type]] = {
    # sender -> receiver: blocks [dst...] of (request, epoch) hold the data now (for
    # one-sided transports), or follow in this message's data frames (two-sided).
    "written": {"xfer": _INT, "req": _STR, "epoch": _INT, "blocks": _LIST, "runs": _LIST},
    # receiver -> sender: the write `xfer` was applied (ok) or refused (reason).
    "ack": {"xfer": _INT, "ok": _BOOL, "reason": _STR},
    # receiver -> sender: stop writing (request, epoch); reply cancel_ack once no write
    # of it can land any more.
    "cancel": {"req": _STR, "epoch": _INT},
    "cancel_ack": {"req": _STR, "epoch": _INT},
    # sender -> receiver, once: set up the data plane's pairwise channel (nccl).
    "join": {},
}


class MessageError(ValueError):
    """A control message that is not one of ours."""


def encode(kind: str, **fields: Any) -> bytes:
    spec = FIELDS[kind]
    if set(fields) != set(spec):
        raise MessageError(f"{kind}: fields {sorted(fields)}, expected {sorted(spec)}")
    return msgpack.packb({"v": VERSION, "kind": kind, **fields}, use_bin_type=True)


def decode(data: bytes) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for garbage
        raise MessageError(f"undecodable control message: {exc}") from None
    if not isinstance(msg, dict):
        raise MessageError(f"control message must be a map, got {type(msg).__name__}")
    if msg.get("v") != VERSION:
        raise MessageError(f"control message version {msg.get('v')!r}, this agent speaks {VERSION}")
    kind = msg.get("kind")
    if kind not in FIELDS:
        raise MessageError(f"unknown control message kind {kind!r}")
    for name, typ in FIELDS[kind].items():
        if not isinstance(msg.get(name), typ) or (typ is int and isinstance(msg.get(name), bool)):
            raise MessageError(f"{kind}.{name} must be {typ.__name__}, got {msg.get(name)!r}")
    return msg
