"""A data plane slower than the acknowledgement timeout (one process, shm, a copy held
back by a gate): a write that times out or is cancelled while its bytes are moving
fails only once they have landed, and only then may the receiver reuse its blocks."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

import kv_transfer.shm as shm
from kv_transfer import KVTransport, Released, TransportConfig, WriteFailed, create_transport
from tests.kv_transfer.agent import cache_shape, poll_both

SENTINEL, PAYLOAD = -7.0, 1.0


def agent(name: str, timeout_s: float) -> KVTransport:
    t = create_transport("shm", name, TransportConfig(timeout_s=timeout_s, cancel_grace_s=60.0))
    cache = t.allocate_kv_cache(cache_shape(), torch.float32, "cpu")
    cache.fill_(SENTINEL)
    t.register_kv_cache(cache, "test-model")
    return t


def gated_copies(sender: KVTransport, gate: threading.Event, pool: ThreadPoolExecutor) -> list[Future]:
    """Every write's copy waits for `gate`; returns the copies' futures as they start."""
    started: list[Future] = []

    def start(peer, write) -> None:
        regions = shm._regions(write, sender._peer_bytes[peer.name], sender._rank_layers,
                               sender.registered_compat.num_layers)
        runs = ([to for to, _ in regions], [frm for _, frm in regions])
        write.handle = pool.submit(lambda: (gate.wait(30), torch._foreach_copy_(*runs)))
        started.append(write.handle)

    sender._start = start
    return started


@pytest.mark.timeout(60)
@pytest.mark.parametrize("abort", [False, True])
def test_a_write_whose_bytes_are_still_moving_fails_only_once_they_have_landed(abort: bool) -> None:
    """Past the sender's 0.1 s timeout, with the copy still held: no WriteFailed yet (the
    sender's source blocks stay in use), and, if the receiver aborted the request, no
    Released (its blocks stay out of use). Both come once the copy is done."""
    decode, prefill = agent("decode", timeout_s=5.0), agent("prefill", timeout_s=0.1)
    gate, pool = threading.Event(), ThreadPoolExecutor(2)
    try:
        prefill.kv_cache[:4].fill_(PAYLOAD)
        copies = gated_copies(prefill, gate, pool)
        prefill.add_peer(decode.metadata())
        # Until the sender's control connection is up, the receiver cannot route a cancel
        # to it (ZMQ drops it); a serving sender connected long before its first write.
        poll_both(prefill, decode, 0.3)
        decode.expect("a", 1, [2, 3], deadline=time.time() + 60, sender="prefill")
        prefill.write("decode", "a", 1, [0, 1], [2, 3], deadline=time.time() + 60)
        if abort:
            decode.abort("a")  # quarantined: released once the sender confirms no byte can land
        sent, received = poll_both(prefill, decode, 0.5)
        assert not [e for e in sent if isinstance(e, WriteFailed)], "failed while its bytes were moving"
        assert not [e for e in received if isinstance(e, Released)], "blocks released under a moving write"

        gate.set()
        sent, received, end = [], [], time.monotonic() + 10
        while not (sent and (received or not abort)):
            assert time.monotonic() < end, "the write never failed after its copy landed"
            more_sent, more_received = poll_both(prefill, decode, 0.01)
            sent += [e for e in more_sent if isinstance(e, WriteFailed)]
            received += [e for e in more_received if isinstance(e, Released)]
        assert copies[0].done()
        timed_out = "no acknowledgement from 'decode' within 0.1 s"
        # Aborted: whichever came first, the receiver's cancel or the sender's timeout.
        assert [e.reason for e in sent] in ([timed_out], ["cancelled"] if abort else [timed_out])
        if abort:
            assert [e.blocks for e in received] == [(2, 3)]
    finally:
        gate.set()
        pool.shutdown(wait=True)
        prefill.close()
        decode.close()
