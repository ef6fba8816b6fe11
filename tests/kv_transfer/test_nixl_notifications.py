"""nixl's "written" notification travels over UCX, outside the CURVE control plane: with
a deployment secret it carries a tag, and a receiver drops (logs, counts) every
notification whose tag does not prove the secret before acting on it."""

from __future__ import annotations

import importlib.util
import logging
import time

import msgpack
import pytest
import torch

from kv_transfer import TransportConfig, create_transport
from kv_transfer.nixl import open_notification, sign_notification
from protocol import encode
from protocol.kv_control import Written
from security import DeploymentSecret
from tests.kv_transfer.agent import cache_shape

SECRET = DeploymentSecret.new()
HEADER = encode(Written(xfer=1, req="a", epoch=1, blocks=[2, 3], runs=[(2, 2)], pieces=[(0, 0, 2, 1)]))


def test_a_tag_proves_the_secret_the_header_and_both_names() -> None:
    signed = sign_notification(SECRET, "prefill", "decode", HEADER)
    assert open_notification(SECRET, "prefill", "decode", signed) == HEADER
    forged = [HEADER,  # no tag
              signed[:-1] + bytes([signed[-1] ^ 1]),  # tag altered
              HEADER.replace(b"\x02", b"\x05", 1) + signed[len(HEADER):],  # header altered
              sign_notification(DeploymentSecret.new(), "prefill", "decode", HEADER),  # another deployment
              b"short"]
    assert [open_notification(SECRET, "prefill", "decode", n) for n in forged] == [None] * len(forged)
    # Good only from that sender, to that receiver.
    assert open_notification(SECRET, "other", "decode", signed) is None
    assert open_notification(SECRET, "prefill", "decode2", signed) is None


@pytest.mark.timeout(60)
@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="the nixl transport needs the nixl package")
def test_a_forged_notification_is_dropped_before_it_is_acted_on(caplog: pytest.LogCaptureFixture) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    receiver = create_transport("nixl", "decode", TransportConfig(timeout_s=5.0, cancel_grace_s=5.0, secret=SECRET))
    # A stranger on the UCX network, naming itself as the receiver's sender: it knows the
    # receiver's NIXL metadata and the reservation, not the secret.
    forger = nixl_agent("prefill", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    try:
        receiver.register_kv_cache(receiver.allocate_kv_cache(cache_shape(), torch.float32, "cpu"), "test-model")
        forger.add_remote_agent(msgpack.unpackb(receiver.metadata(), raw=False)["data"]["agent"])
        receiver.expect("a", 1, [2, 3], deadline=time.time() + 60, sender="prefill")

        def events_after(notification: bytes, count: int) -> list:
            forger.send_notif("decode", notification)
            events, end = [], time.monotonic() + 10
            while receiver.stats["notifications_refused"] < count and not events:
                assert time.monotonic() < end, "the notification never arrived"
                events += receiver.poll()
                forger.get_new_notifs()  # UCX progresses on its side too (no progress thread)
                time.sleep(0.005)
            return events + receiver.poll()

        with caplog.at_level(logging.WARNING, logger="kv_transfer.nixl"):
            assert events_after(HEADER, 1) == []
            assert events_after(sign_notification(DeploymentSecret.new(), "prefill", "decode", HEADER), 2) == []
        assert receiver.stats["notifications_refused"] == 2
        assert receiver.holds_reservations()
        assert sum("does not prove the deployment's secret" in r.getMessage() for r in caplog.records) == 1
        # The same header, tagged with the secret, is acted on: the reservation completes.
        events = events_after(sign_notification(SECRET, "prefill", "decode", HEADER), 3)
        assert [(type(e).__name__, e.req) for e in events] == [("Received", "a"), ("Completed", "a")]
        assert receiver.stats["notifications_refused"] == 2
    finally:
        receiver.close()
