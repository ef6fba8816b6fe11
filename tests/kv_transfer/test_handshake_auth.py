"""With the deployment's secret (TransportConfig.secret), the control plane admits only
its holders: agents sharing it transfer as before; a handshake blob without its tag,
or with another's, is refused by add_peer naming why; and a stranger's message on the
control socket never arrives, however well-formed (one process, CPU transports)."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch
import zmq

from kv_transfer import IncompatiblePeerError
from kv_transfer.events import Completed, WriteDone
from protocol import encode
from protocol.kv_control import Written
from security import DeploymentSecret, connect_securely
from tests.kv_transfer.agent import cpu_agent, fill, poll_both

PAYLOAD_SEED = 5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_agents_sharing_a_secret_transfer_intact(transport: str) -> None:
    secret = DeploymentSecret.new()
    decode, prefill = cpu_agent(transport, "decode", secret), cpu_agent(transport, "prefill", secret)
    try:
        fill(prefill.kv_cache, PAYLOAD_SEED)
        assert prefill.add_peer(decode.metadata()) == "decode"
        prefill.warm_up("decode")
        decode.expect("a", 1, [5, 6, 7], deadline=time.time() + 60, sender="prefill")
        prefill.write("decode", "a", 1, [0, 1, 2], [5, 6, 7], deadline=time.time() + 60)
        sent, received, end = [], [], time.monotonic() + 20
        while not (any(isinstance(e, WriteDone) for e in sent) and any(isinstance(e, Completed) for e in received)):
            assert time.monotonic() < end, f"no transfer: {sent} {received}"
            more_sent, more_received = poll_both(prefill, decode, 0.02)
            sent, received = sent + more_sent, received + more_received
        assert torch.equal(decode.kv_cache[[5, 6, 7]], prefill.kv_cache[[0, 1, 2]])
        assert decode.control.refused == prefill.control.refused == 0
    finally:
        prefill.close()
        decode.close()


def _retagged(blob: bytes, **changes) -> bytes:
    """`blob` with fields changed (or removed, for None), its tag left as it was."""
    meta = msgpack.unpackb(blob, raw=False)
    for key, value in changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    return msgpack.packb(meta, use_bin_type=True)


@pytest.mark.timeout(60)
def test_a_forged_handshake_is_refused_naming_why() -> None:
    secret = DeploymentSecret.new()
    decode, prefill = cpu_agent("shm", "decode", secret), cpu_agent("shm", "prefill", secret)
    stranger, plain = cpu_agent("shm", "decode", DeploymentSecret.new()), cpu_agent("shm", "decode", None)
    try:
        genuine = decode.metadata()
        forged = {
            "carries no tag": _retagged(genuine, tag=None),  # tag stripped
            "tag is not this deployment's": _retagged(genuine, control="tcp://127.0.0.1:1"),  # redirected
        }
        forged["carries no tag "] = plain.metadata()  # a transport without the secret
        forged["tag is not this deployment's "] = stranger.metadata()  # another deployment's
        for reason, blob in forged.items():
            with pytest.raises(IncompatiblePeerError, match=reason.strip()):
                prefill.add_peer(blob)
            assert prefill.control.peers == {}  # nothing connected to what it names
        # A transport without a secret cannot reach one that has it, and says so.
        with pytest.raises(IncompatiblePeerError, match="holds a deployment secret and this agent none"):
            plain.add_peer(genuine)
        assert prefill.add_peer(genuine) == "decode"  # the genuine blob still works
    finally:
        for t in (prefill, decode, stranger, plain):
            t.close()


@pytest.mark.timeout(60)
def test_a_strangers_written_message_never_arrives() -> None:
    """A well-formed `written` for a reserved request, which the receiver would accept
    as KV landed (shm is one-sided) from anyone who reached its socket: from a plain
    socket or another deployment's it never arrives; each is refused and counted."""
    secret = DeploymentSecret.new()
    decode = cpu_agent("shm", "decode", secret)
    ctx = zmq.Context()
    try:
        decode.expect("a", 1, [2, 3], deadline=time.time() + 60, sender="prefill")
        for key in (None, DeploymentSecret.new()):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, b"prefill")
            if key is not None:
                connect_securely(sock, key)
            sock.connect(decode.control_address)
            sock.send(encode(Written(xfer=1, req="a", epoch=1, blocks=[2, 3], runs=[(2, 2)],
                                     pieces=[(0, 0, 2, 1)])))
        events, end = [], time.monotonic() + 1.5
        while time.monotonic() < end:
            events += decode.poll()
            time.sleep(0.01)
        assert events == []
        assert decode.control.refused >= 2
    finally:
        ctx.destroy(0)
        decode.close()
