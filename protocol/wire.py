"""How every message between pdserve's processes is typed and put on the wire.

A message is a frozen msgspec Struct, tagged with its `kind`, and carries the protocol
version `v`. It goes over ZMQ (and the launchers' control channels) as msgpack, never
pickle. decode() checks everything a peer sent against the declared types (a bool is
not an int, no unknown field, every field without a default present, the version ours;
a message without `v` is taken as this version) and refuses anything else with a
MessageError that names the problem, so a bad peer can neither crash nor confuse a
worker.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

# Bump when any message changes shape: peers of another version are refused by name.
# 14: StatsReply.stats is a typed WorkerStats (protocol/stats.py), no longer a map, and the KV
# transports' control messages (protocol/kv_control.py) are typed under this version.
# 15: WorkerStats has kv_transport, kv_fabric (both roles) and refused (prefill).
# 16: StatsReply.kv_events carry each block's tier; WorkerStats has kv_tiers (both roles).
# 17: StatsReply.kv_events may carry tier 3 (the shared KV store); the store's messages
# (protocol/kv_store.py) are typed under this version.
# 18: StoreDirectory has capacity_bytes and used_bytes (the store's, for the workers' stats);
# StoreDrop.
# 19: Generate has queue_tag, RemotePrefill priority and queue_tag; WorkerStats has
# step_seconds_by_requests and step_seconds_by_tokens (StepTimes, both roles).
# 20: RemotePrefill has layer_first_blocks (what P writes of each block, by layer).
# 21: Generate and RemotePrefill have lora (LoRASpec); WorkerStats has lora_adapters.
PROTOCOL_VERSION = 21


class MessageError(ValueError):
    """Bytes that are not one of our messages. `kind` and `request_id` are what could
    be read of it (None when nothing could), so that a worker can still tell the
    sender which of its requests it refused."""

    def __init__(self, problem: str, kind: str | None = None, request_id: str | None = None) -> None:
        super().__init__(problem)
        self.kind, self.request_id = kind, request_id


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="kind"):
    """Base of every message; subclasses give `tag=` (their kind) and their fields."""

    v: int = PROTOCOL_VERSION

    @property
    def kind(self) -> str:
        tag = self.__struct_config__.tag
        assert isinstance(tag, str)  # each message class names its kind: tag="..."
        return tag

    def __post_init__(self) -> None:
        if self.v != PROTOCOL_VERSION:
            raise ValueError(f"protocol version {self.v!r}, this side speaks {PROTOCOL_VERSION}")


class _Header(msgspec.Struct):
    """What can be read of a message that failed to decode."""

    v: Any = None
    kind: Any = None
    request_id: Any = None


_encoder = msgspec.msgpack.Encoder()
_header = msgspec.msgpack.Decoder(_Header)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


class Codec:
    """Decodes the messages of the given kinds (a tagged union of them)."""

    def __init__(self, *kinds: type[Message]) -> None:
        self._decoder = msgspec.msgpack.Decoder(Union[kinds])  # noqa: UP007  # type: ignore[valid-type]  # a union built at run time from the kinds given; `|` needs them written out

    def decode(self, data: bytes) -> Any:
        try:
            return self._decoder.decode(data)
        except RecursionError:  # msgpack nested past the interpreter's limit: no message of ours is
            raise MessageError("message: nested too deep") from None
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            kind = request_id = None
            reason = str(exc)
            try:
                header = _header.decode(data)
                kind = header.kind if isinstance(header.kind, str) else None
                request_id = header.request_id if isinstance(header.request_id, str) else None
                if header.v != PROTOCOL_VERSION:  # a peer of another version: say that, not what it lacks
                    reason = f"protocol version {header.v!r}, this side speaks {PROTOCOL_VERSION}"
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                pass
            raise MessageError(f"{kind or 'message'}: {reason}"[:1000], kind, request_id) from None
