"""What a broken or hostile peer sends is refused with an error naming the problem, and
the receiver keeps working (one process, shm); closing twice is harmless."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from kv_transfer import IncompatiblePeerError
from kv_transfer.control import HANDSHAKE_VERSION
from protocol import PROTOCOL_VERSION, MessageError, encode
from protocol.kv_control import KV_CONTROL_MESSAGES, Written
from tests.kv_transfer.agent import cpu_agent


@pytest.mark.parametrize("blocks,runs", [([[2], 3], [[2, 2]]), ([2, "3"], [[2, 2]]), ([2, True], [[2, 2]]),
                                         ([2, 3], [[2]]), ([2, 3], [2, 2]), ([2, 3], [[2, 2.0]])])
def test_a_written_message_with_malformed_block_ids_is_refused_naming_the_field(blocks, runs) -> None:
    with pytest.raises(MessageError, match=r"^written: Expected .* - at `\$\.(blocks|runs)"):
        KV_CONTROL_MESSAGES.decode(msgpack.packb({"v": PROTOCOL_VERSION, "kind": "written", "xfer": 1, "req": "a",
                                                  "epoch": 1, "blocks": blocks, "runs": runs,
                                                  "pieces": [[0, 0, 2, 1]]}))
    assert KV_CONTROL_MESSAGES.decode(encode(Written(xfer=1, req="a", epoch=1, blocks=[2, 3], runs=[(2, 2)],
                                                     pieces=[(0, 0, 2, 1)]))).blocks == [2, 3]


def test_a_control_message_of_another_version_or_kind_is_refused_naming_it() -> None:
    with pytest.raises(MessageError, match=f"protocol version 4, this side speaks {PROTOCOL_VERSION}"):
        KV_CONTROL_MESSAGES.decode(msgpack.packb({"v": 4, "kind": "ack", "xfer": 1, "ok": True, "reason": ""}))
    with pytest.raises(MessageError, match="missing required field `reason`"):
        KV_CONTROL_MESSAGES.decode(msgpack.packb({"v": PROTOCOL_VERSION, "kind": "ack", "xfer": 1, "ok": True}))
    with pytest.raises(MessageError, match="Invalid value 'generate'"):  # a worker message is not a KV one
        KV_CONTROL_MESSAGES.decode(msgpack.packb({"v": PROTOCOL_VERSION, "kind": "generate", "request_id": "a"}))


@pytest.mark.timeout(30)
def test_the_receiver_drops_a_malformed_write_and_keeps_polling() -> None:
    receiver = cpu_agent("shm", "decode")
    sock = receiver.control.ctx.socket(zmq.DEALER)
    try:
        receiver.expect("a", 1, [2, 3], deadline=time.time() + 60, sender="prefill")
        sock.setsockopt(zmq.ROUTING_ID, b"prefill")
        sock.connect(receiver.control_address)
        sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "kind": "written", "xfer": 1, "req": "a", "epoch": 1,
                                 "blocks": [[2], 3], "runs": [[2, 2]], "pieces": [[0, 0, 2, 1]]}))
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            assert receiver.poll() == []  # dropped with a warning, not raised out of poll()
    finally:
        sock.close(0)
        receiver.close()


@pytest.mark.parametrize("field", ["name", "control", "compat", "num_blocks", "data"])
def test_handshake_metadata_without_a_field_is_refused_naming_it(field: str) -> None:
    receiver, sender = cpu_agent("shm", "decode"), cpu_agent("shm", "prefill")
    try:
        meta = msgpack.unpackb(receiver.metadata(), raw=False)
        del meta[field]
        with pytest.raises(IncompatiblePeerError, match=f"handshake metadata lacks {field}"):
            sender.add_peer(msgpack.packb(meta, use_bin_type=True))
    finally:
        sender.close()
        receiver.close()


def test_closing_after_the_segment_was_removed_closes_everything() -> None:
    t = cpu_agent("shm", "decode")
    from kv_transfer.shm_segments import unlink_segment

    unlink_segment(t.metadata())  # as the launcher does once a worker is gone
    t.close()
    assert t.control.router.closed and t.control.ctx.closed


@pytest.mark.timeout(30)
def test_a_cancelled_request_is_forgotten_once_its_deadline_passes() -> None:
    """The sender refuses writes of a cancelled (request, epoch) until the reservation's
    deadline (after which it refuses them anyway), then drops the entry: no state kept
    per aborted request forever."""
    receiver, sender = cpu_agent("shm", "decode"), cpu_agent("shm", "prefill")
    try:
        sender.add_peer(receiver.metadata())
        end = time.monotonic() + 0.3  # the sender's control connection comes up
        while time.monotonic() < end:
            receiver.poll(), sender.poll()
        deadline = time.time() + 2.0
        receiver.expect("a", 1, [2, 3], deadline=deadline, sender="prefill")
        receiver.abort("a")
        end = time.monotonic() + 1.5
        while ("a", 1) not in sender.sending.cancelled:
            assert time.monotonic() < end, "the cancel never reached the sender"
            receiver.poll(), sender.poll()
            time.sleep(0.01)
        xfer = sender.write("decode", "a", 1, [0, 1], [2, 3], deadline=deadline)
        assert [(e.xfer, e.reason) for e in sender.poll()] == [(xfer, "cancelled")]
        while time.time() <= deadline:
            time.sleep(0.05)
        sender.poll()
        assert ("a", 1) not in sender.sending.cancelled
    finally:
        sender.close()
        receiver.close()


def test_a_peer_speaking_another_protocol_version_is_refused_at_the_handshake_naming_it() -> None:
    receiver, sender = cpu_agent("shm", "decode"), cpu_agent("shm", "prefill")
    try:
        meta = msgpack.unpackb(receiver.metadata(), raw=False)
        meta["protocol_version"] = PROTOCOL_VERSION - 1
        with pytest.raises(IncompatiblePeerError, match=f"it speaks protocol version {PROTOCOL_VERSION - 1}, "
                                                        f"this side {PROTOCOL_VERSION}"):
            sender.add_peer(msgpack.packb(meta, use_bin_type=True))
    finally:
        sender.close()
        receiver.close()


def test_a_peer_from_before_kv_scales_is_refused_by_its_handshake_version() -> None:
    """A version-3 peer's compatibility record has no kv_scales: the version check names
    it, before the record could be called malformed."""
    receiver, sender = cpu_agent("shm", "decode"), cpu_agent("shm", "prefill")
    try:
        meta = msgpack.unpackb(receiver.metadata(), raw=False)
        meta["v"] = 3
        meta["compat"].pop("kv_scales")
        with pytest.raises(IncompatiblePeerError, match=f"handshake version 3, this agent speaks {HANDSHAKE_VERSION}"):
            sender.add_peer(msgpack.packb(meta, use_bin_type=True))
    finally:
        sender.close()
        receiver.close()
