"""Every transport, between processes: bytes intact, many writes in flight, loud
failures within the deadline, refused handshakes, and no late write in a reused block."""

from __future__ import annotations

import random
import time

import msgpack
import pytest
import torch

from kv_transfer import GPU_ONLY, TRANSPORTS, IncompatiblePeerError, KVTransport, TransportConfig, create_transport
from kv_transfer.runs import coalesce
from tests.kv_transfer.agent import Secured, cache_shape, fill, packed, secret_of
from tests.kv_transfer.conftest import RemoteAgent

SENTINEL = -7.0
UNDER_TEST = sorted(set(TRANSPORTS) - GPU_ONLY)  # cuda_ipc: benchmarks/gpu_check.py
# Also with the deployment's secret, as launched workers run: nccl's rendezvous store and
# nixl's notifications are then authenticated.
SECURED = [pytest.param(Secured(name), id=f"{name}-secret") for name in ("nccl", "nixl")]


def local_agent(transport: str, name: str, timeout_s: float = 5.0, grace_s: float = 5.0,
                block_size: int = 16) -> KVTransport:
    t = create_transport(str(transport), name, TransportConfig(timeout_s=timeout_s, cancel_grace_s=grace_s,
                                                               secret=secret_of(transport)))
    cache = t.allocate_kv_cache(cache_shape(block_size=block_size), torch.float32, "cpu")
    cache.fill_(SENTINEL)
    t.register_kv_cache(cache, "test-model")
    return t


def source_cache(seed: int) -> torch.Tensor:
    cache = torch.empty(cache_shape())
    fill(cache, seed)
    return cache


def wait_for(agent: RemoteAgent, local: KVTransport, count: int, kinds: tuple[str, ...],
             timeout: float = 20.0) -> list[dict]:
    """Poll the child until it reports `count` events of `kinds` (the local side polls too)."""
    seen, end = [], time.monotonic() + timeout
    while len(seen) < count:
        assert time.monotonic() < end, f"only {len(seen)} of {count} {kinds} events: {seen}"
        seen += [e for e in agent.call("poll", seconds=0.05)["events"] if e["type"] in kinds]
    return seen


def drain(local: KVTransport, seconds: float) -> list:
    events, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        events += local.poll()
        time.sleep(0.002)
    return events


@pytest.fixture(params=[*UNDER_TEST, *SECURED])
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def decode(transport: str):
    t = local_agent(transport, "decode")
    yield t
    t.close()


@pytest.mark.timeout(120)
def test_random_block_sets_arrive_intact(transport: str, decode: KVTransport, agents) -> None:
    prefill = RemoteAgent(transport, "prefill", seed=1, local=decode)
    agents.append(prefill)
    # Pre-warmed (the handshake done before any write); decode polls meanwhile.
    peer = prefill.call("add_peer", meta=decode.metadata(), warm=True)["peer"]
    assert peer == "decode"
    rng = random.Random(0)
    free = list(range(64))
    rng.shuffle(free)
    plans = []  # (request, [(src, dst) per write])
    for i in range(8):
        n = rng.randint(1, 9)
        start = rng.randrange(0, 64 - n)
        # Consecutive runs on one side or both, scattered blocks, single blocks.
        src = list(range(start, start + n)) if i % 2 == 0 else rng.sample(range(64), n)
        dst = sorted(free.pop() for _ in range(n)) if i % 3 else [free.pop() for _ in range(n)]
        decode.expect(f"req{i}", 3, dst, deadline=time.time() + 60, sender="prefill")
        half = max(1, n // 2) if i == 0 else n  # req0 arrives as two chunks
        plans.append((f"req{i}", [(src[:half], dst[:half])] + ([(src[half:], dst[half:])] if half < n else [])))
    deadline = time.time() + 60
    for req, writes in plans:  # all in flight together
        for src, dst in writes:
            prefill.call("write", peer=peer, req=req, epoch=3, src=src, dst=dst, deadline=deadline)
    num_writes = sum(len(w) for _, w in plans)
    done = wait_for(prefill, decode, num_writes, ("WriteDone", "WriteFailed"))
    assert all(e["type"] == "WriteDone" for e in done), done
    events = prefill.local_events + drain(decode, 0.1)
    completed = sorted(e.req for e in events if type(e).__name__ == "Completed")
    assert completed == sorted(req for req, _ in plans)

    expected = source_cache(seed=1)
    written = set()
    for _, writes in plans:
        for src, dst in writes:
            assert torch.equal(decode.kv_cache[dst], expected[src])
            written |= set(dst)
    untouched = [b for b in range(64) if b not in written]
    assert (decode.kv_cache[untouched] == SENTINEL).all(), "a block nobody wrote to changed"
    stats = prefill.call("poll", seconds=0)["stats"]
    limit = type(decode).max_run_bytes  # tcp bounds a descriptor's bytes
    cap = None if limit is None else max(1, limit // decode.registered_compat.block_bytes)
    assert stats["descriptors"] == sum(len(coalesce(s, d, cap)) for _, w in plans for s, d in w)
    assert stats["writes_done"] == num_writes and decode.stats["late_writes_dropped"] == 0


@pytest.mark.timeout(60)
def test_mismatched_layout_is_refused_naming_the_field(transport: str, decode: KVTransport, agents) -> None:
    prefill = RemoteAgent(transport, "prefill", seed=1, block_size=32)
    agents.append(prefill)
    with pytest.raises(RuntimeError, match="IncompatiblePeerError.*block_size is 16 there, 32 here"):
        prefill.call("add_peer", meta=decode.metadata())
    other = next(name for name in TRANSPORTS if name != transport)
    meta = msgpack.unpackb(decode.metadata(), raw=False)
    meta["transport"] = other
    with pytest.raises(RuntimeError, match=f"transport is '{other}' there, '{transport}' here"):
        prefill.call("add_peer", meta=packed(meta, transport))
    local = local_agent(transport, "other")
    try:
        meta = msgpack.unpackb(decode.metadata(), raw=False)
        meta["compat"]["dtype"] = "bfloat16"
        with pytest.raises(IncompatiblePeerError, match="dtype is 'bfloat16' there, 'float32' here"):
            local.add_peer(packed(meta, transport))
    finally:
        local.close()


@pytest.mark.timeout(60)
def test_receiver_killed_mid_transfer_fails_within_deadline(transport: str, agents) -> None:
    sender = local_agent(transport, "prefill", timeout_s=1.0)
    receiver = RemoteAgent(transport, "decode", seed=2, local=sender)
    agents.append(receiver)
    try:
        peer = sender.add_peer(receiver.metadata)
        receiver.call("expect", req="a", epoch=1, blocks=[0, 1, 2], deadline=time.time() + 60)
        receiver.kill()
        start = time.monotonic()
        sender.write(peer, "a", 1, [5, 6, 7], [0, 1, 2], deadline=time.time() + 60)
        events = []
        while not events:
            assert time.monotonic() - start < 5, "no failure reported: the write hangs"
            events = [e for e in sender.poll() if type(e).__name__ in ("WriteDone", "WriteFailed")]
        # Either the data plane noticed (NIXL: remote disconnect) or the ack timed out.
        assert type(events[0]).__name__ == "WriteFailed", events
        assert "within 1.0 s" in events[0].reason or "data plane error" in events[0].reason
        assert time.monotonic() - start < 3
    finally:
        sender.close()


@pytest.mark.timeout(60)
def test_a_killed_senders_reservation_expires_and_is_released_once_its_process_is_gone(transport: str,
                                                                                      agents) -> None:
    """One-sided: the receiver checks the sender's process (its hello's pid and start
    time) and lifts the fence itself once it has exited, with no word from a supervisor."""
    receiver = local_agent(transport, "decode", grace_s=30.0)  # no timer could release it in the test's time
    try:
        sender = RemoteAgent(transport, "prefill", seed=1, local=receiver)
        agents.append(sender)
        sender.call("add_peer", meta=receiver.metadata())
        end = time.monotonic() + 10
        while "prefill" not in receiver.receiving.senders:  # its hello
            assert time.monotonic() < end, "the sender's hello never came"
            receiver.poll()
        receiver.expect("a", 1, [3, 4], deadline=time.time() + 1.0, sender="prefill")
        sender.kill()
        events = drain(receiver, 2.5)
        assert [type(e).__name__ for e in events] == ["Expired", "Released"]
        assert events[1].blocks == (3, 4) and receiver.stats["expired"] == 1
    finally:
        receiver.close()


@pytest.mark.timeout(60)
def test_late_write_never_lands_in_a_reused_block(transport: str, agents) -> None:
    decode = local_agent(transport, "decode", grace_s=30.0)  # Released must come from the ack
    try:
        prefill = RemoteAgent(transport, "prefill", seed=1, local=decode)
        agents.append(prefill)
        peer = prefill.call("add_peer", meta=decode.metadata())["peer"]
        prefill.call("poll", seconds=0.2)  # let any pairwise channel (nccl) finish joining
        blocks = [10, 11, 12]
        decode.expect("a", 1, blocks, deadline=time.time() + 60, sender="prefill")
        # The write races the abort: its bytes may land before decode hears of it. Decode
        # does not poll until it has aborted, so the reservation cannot complete first.
        prefill.call("write", poll_local=False, peer=peer, req="a", epoch=1, src=[20, 21, 22],
                     dst=blocks, deadline=time.time() + 60)
        decode.abort("a")
        released, end = [], time.monotonic() + 10
        while not released:
            assert time.monotonic() < end, "the aborted request's blocks were never released"
            prefill.call("poll", seconds=0.02)
            released = [e for e in prefill.local_events + decode.poll() if type(e).__name__ == "Released"]
        assert released[0].blocks == tuple(blocks)
        # The blocks are reused for request b; a's writes keep coming, late.
        decode.expect("b", 1, blocks, deadline=time.time() + 60, sender="prefill")
        for _ in range(2):
            prefill.call("write", peer=peer, req="a", epoch=1, src=[20, 21, 22], dst=blocks,
                         deadline=time.time() + 60)
        prefill.call("write", peer=peer, req="b", epoch=1, src=[30, 31, 32], dst=blocks,
                     deadline=time.time() + 60)
        outcomes = wait_for(prefill, decode, 1, ("WriteDone",))
        assert [e["req"] for e in outcomes] == ["b"]
        prefill.call("poll", seconds=0.2)
        assert torch.equal(decode.kv_cache[blocks], source_cache(seed=1)[[30, 31, 32]])
        assert decode.stats["late_writes_dropped"] + prefill.call("poll", seconds=0)["stats"]["writes_failed"] >= 2
    finally:
        decode.close()


@pytest.mark.timeout(60)
def test_a_sender_declared_gone_that_has_exited_releases_its_reservations_at_once(transport: str, agents) -> None:
    receiver = local_agent(transport, "decode", grace_s=30.0)  # no waiting for the grace period
    try:
        sender = RemoteAgent(transport, "prefill", seed=1, local=receiver)
        agents.append(sender)
        sender.call("add_peer", meta=receiver.metadata())
        receiver.expect("a", 1, [3, 4], deadline=time.time() + 60, sender="prefill")
        receiver.expect("b", 1, [5], deadline=time.time() + 60, sender="another")
        sender.kill()
        receiver.peer_gone("prefill")
        events = receiver.poll()
        assert [(type(e).__name__, e.req, getattr(e, "blocks", None)) for e in events] == [
            ("Expired", "a", None), ("Released", "a", (3, 4))]
        assert not drain(receiver, 0.2)  # b's sender lives: its reservation stays
    finally:
        receiver.close()


@pytest.mark.timeout(90)
def test_a_restarted_receiver_replaces_the_dead_one(transport: str, agents) -> None:
    """Same agent name, new metadata (a restarted decode worker): writes in flight to
    the old one fail at once, and writes go to the new one, intact."""
    sender = local_agent(transport, "prefill")
    sender.kv_cache.copy_(source_cache(seed=1))
    try:
        old = RemoteAgent(transport, "decode", seed=2, local=sender)
        agents.append(old)
        assert sender.add_peer(old.metadata) == "decode"
        old.call("expect", req="a", epoch=1, blocks=[0, 1], deadline=time.time() + 60)
        old.kill()
        sender.write("decode", "a", 1, [5, 6], [0, 1], deadline=time.time() + 60)
        new = RemoteAgent(transport, "decode", seed=3, local=sender)
        agents.append(new)
        assert new.metadata != old.metadata
        assert sender.add_peer(new.metadata) == "decode"  # replaces the old peer
        assert sender.add_peer(new.metadata) == "decode"  # the same blob again: no-op
        failed = [e for e in drain(sender, 0.1) if type(e).__name__ == "WriteFailed"]
        assert [e.req for e in failed] == ["a"]  # nccl's data plane may notice the death first
        assert failed[0].reason == "peer 'decode' is gone" or "data plane error" in failed[0].reason
        new.call("expect", req="b", epoch=1, blocks=[7, 8, 9], deadline=time.time() + 60)
        new.call("poll", seconds=0.3)  # let the pairwise channel (nccl) join
        sender.write("decode", "b", 1, [10, 11, 20], [7, 8, 9], deadline=time.time() + 60)
        done = []
        end = time.monotonic() + 20
        while not done:
            assert time.monotonic() < end, "the write to the restarted receiver never finished"
            new.call("poll", seconds=0.02)
            done = [e for e in new.local_events if type(e).__name__ in ("WriteDone", "WriteFailed")]
        assert type(done[0]).__name__ == "WriteDone", done
        data = torch.frombuffer(bytearray(new.call("blocks", ids=[7, 8, 9])["data"]), dtype=torch.float32)
        assert torch.equal(data.view(3, *cache_shape()[1:]), source_cache(seed=1)[[10, 11, 20]])
    finally:
        sender.close()


@pytest.mark.timeout(90)
def test_a_restarted_sender_writes_again_under_the_same_name(transport: str, agents) -> None:
    """The prefill side dies and comes back as a new process with the same agent name:
    the receiver drops the dead one and takes writes from the new one, intact (nccl
    makes a new pairwise group for the new session)."""
    receiver = local_agent(transport, "decode")
    try:
        first = RemoteAgent(transport, "prefill", seed=1, local=receiver)
        agents.append(first)
        first.call("add_peer", meta=receiver.metadata(), warm=True)
        first.kill()
        receiver.peer_gone("prefill")
        second = RemoteAgent(transport, "prefill", seed=5, local=receiver)
        agents.append(second)
        peer = second.call("add_peer", meta=receiver.metadata(), warm=True)["peer"]
        receiver.expect("b", 1, [30, 31], deadline=time.time() + 60, sender="prefill")
        second.call("write", peer=peer, req="b", epoch=1, src=[3, 4], dst=[30, 31], deadline=time.time() + 60)
        done = wait_for(second, receiver, 1, ("WriteDone", "WriteFailed"))
        assert done[0]["type"] == "WriteDone", done
        assert torch.equal(receiver.kv_cache[[30, 31]], source_cache(seed=5)[[3, 4]])
    finally:
        receiver.close()
