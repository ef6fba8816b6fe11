"""Writes of a layer range (transport_options.stream: layer): the receiver counts a block in
only once every layer of it has come, on every transport and between TP sizes; bad
ranges are refused, naming them."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from kv_transfer import Completed, Received, WriteDone, WriteFailed
from protocol import encode
from protocol.kv_control import Written
from tests.kv_transfer.agent import cpu_agent, poll_both
from tests.kv_transfer.conftest import RemoteAgent
from tests.kv_transfer.test_tp_transfers import (
    LAYERS,
    MULTI_RANK,
    SENTINEL,
    WRITES,
    make,  # noqa: F401  (the fixture)
    poll_until_done,
    reserved_pair,
)
from tests.kv_transfer.test_transports import SECURED, UNDER_TEST, drain, local_agent, source_cache, wait_for


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", [*UNDER_TEST, *SECURED])
def test_a_block_completes_only_once_its_last_layer_lands(transport: str, agents) -> None:
    decode = local_agent(transport, "decode")
    try:
        prefill = RemoteAgent(transport, "prefill", seed=3, local=decode)
        agents.append(prefill)
        peer = prefill.call("add_peer", meta=decode.metadata(), warm=True)["peer"]
        src, dst = [0, 1, 2, 9], [20, 21, 22, 5]  # a run of three and a lone block
        decode.expect("a", 1, dst, deadline=time.time() + 60, sender="prefill")
        deadline, num_layers = time.time() + 60, decode.registered_compat.num_layers
        expected = source_cache(seed=3)
        for layer in range(num_layers):
            prefill.call("write", peer=peer, req="a", epoch=1, src=src, dst=dst, deadline=deadline,
                         layers=[layer, layer + 1])
            done = wait_for(prefill, decode, 1, ("WriteDone", "WriteFailed"))
            assert [e["type"] for e in done] == ["WriteDone"], done
            events = prefill.local_events + drain(decode, 0.05)
            prefill.local_events.clear()
            ended = [type(e).__name__ for e in events if isinstance(e, (Received, Completed))]
            last = layer == num_layers - 1
            assert ended == (["Received", "Completed"] if last else []), (layer, events)
            # Layers so far landed, the ones after untouched: one layer is never the block.
            assert torch.equal(decode.kv_cache[dst, :, :layer + 1], expected[src, :, :layer + 1])
            assert (decode.kv_cache[dst, :, layer + 1:] == SENTINEL).all()
        stats = prefill.call("poll", seconds=0)["stats"]
        heads = decode.registered_compat.num_kv_heads
        assert stats["regions"] == len(src) * heads * num_layers
        # Two runs; tcp and nccl gather each run's layer into one frame or send, the
        # others move a region per block and head.
        assert stats["descriptors"] == (2 if transport in ("tcp", "nccl") else len(src) * heads) * num_layers
        assert stats["bytes_written"] == len(src) * decode.registered_compat.block_bytes
    finally:
        decode.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", MULTI_RANK)
@pytest.mark.parametrize("kv_heads,p,d,planes", [(2, 1, 1, 2), (2, 2, 2, 2), (2, 1, 2, 2), (2, 2, 1, 2),
                                                 (4, 2, 4, 2), (1, 1, 2, 1), (1, 2, 1, 1)])
def test_layer_by_layer_between_tp_sizes_each_rank_gets_its_heads_of_every_layer(
        make, transport: str, kv_heads: int, p: int, d: int, planes: int) -> None:  # noqa: F811
    whole, decode, prefill = reserved_pair(make, transport, kv_heads, p, d, planes)
    received: list[str] = []
    for layer in range(LAYERS):
        for i, (src, dst) in enumerate(WRITES):
            prefill.t.write("decode", f"r{i}", 1, src, dst, deadline=time.time() + 60, layers=(layer, layer + 1))
        events = poll_until_done(prefill.t, decode.t, len(WRITES), lambda e: received.append(e.req))
        assert all(isinstance(e, WriteDone) for e in events if isinstance(e, (WriteDone, WriteFailed))), events
        assert sorted(received) == ([f"r{i}" for i in range(len(WRITES))] if layer == LAYERS - 1 else [])
        for r, ((start, end), cache) in enumerate(zip(decode.ranges, decode.caches)):
            for src, dst in WRITES:
                assert torch.equal(cache[dst, :, :layer + 1], whole[src, start:end, :layer + 1]), f"rank {r}"
                assert (cache[dst, :, layer + 1:] == SENTINEL).all(), f"rank {r}: a layer not yet written changed"
    assert decode.t.stats["late_writes_dropped"] == 0


def test_a_write_of_no_layer_range_is_refused_naming_it() -> None:
    decode, prefill = cpu_agent("tcp", "decode"), cpu_agent("tcp", "prefill")
    try:
        prefill.add_peer(decode.metadata())
        for bad in [(1, 1), (-1, 1), (0, 3), (2, 1)]:
            with pytest.raises(ValueError, match=r"not a range of the cache's 2 layers"):
                prefill.write("decode", "a", 1, [0], [1], time.time() + 5, layers=bad)
    finally:
        decode.close()
        prefill.close()


def test_the_receiver_refuses_a_notification_naming_layers_its_cache_lacks() -> None:
    """A peer (a bug, or another model) naming layers past the cache's: refused, nothing counted in."""
    decode, prefill = cpu_agent("shm", "decode"), cpu_agent("shm", "prefill")
    try:
        prefill.add_peer(decode.metadata())
        decode.expect("a", 1, [2, 3], deadline=time.time() + 5, sender="prefill")
        peer = prefill.control.peers["decode"]
        peer.socket.send(encode(Written(xfer=1, req="a", epoch=1, blocks=[2, 3], runs=[(2, 2)],
                                        pieces=[(0, 0, 2, 1)], layers=(1, 5))))
        received = poll_both(prefill, decode, 0.3)[1]
        assert not [e for e in received if isinstance(e, (Received, Completed))]
        assert decode.stats["late_writes_dropped"] == 1
    finally:
        decode.close()
        prefill.close()


def test_a_given_up_streams_dropped_layer_writes_are_counted_each_and_warned_once(caplog) -> None:
    """A reservation given up with a write per layer group in flight: every write is
    refused and counted, and one warning says so (not one per layer)."""
    decode, prefill = cpu_agent("tcp", "decode"), cpu_agent("tcp", "prefill")
    try:
        prefill.add_peer(decode.metadata())
        decode.expect("a", 1, [2, 3], deadline=time.time() + 5, sender="prefill")
        decode.abort("a")
        with caplog.at_level(logging.DEBUG, logger="kv_transfer.receiver"):
            for layer in range(2):
                prefill.write("decode", "a", 1, [0, 1], [2, 3], time.time() + 5, layers=(layer, layer + 1))
            prefill.write("decode", "a", 1, [0, 1], [2, 3], time.time() + 5)
            sent, _ = poll_both(prefill, decode, 0.3)
        assert [type(e) for e in sent if isinstance(e, (WriteDone, WriteFailed))] == [WriteFailed] * 3
        assert decode.stats["late_writes_dropped"] == 3
        dropped = [r for r in caplog.records if r.getMessage().startswith("dropped a write")]
        assert [r.levelno for r in dropped] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    finally:
        decode.close()
        prefill.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", UNDER_TEST)
def test_a_block_awaits_only_the_layers_its_mask_names(transport: str, agents) -> None:
    """A mixed local/global model's push: a block before the local layers' window is
    reserved for its global layers alone, and completes once they have come."""
    decode = local_agent(transport, "decode")
    try:
        prefill = RemoteAgent(transport, "prefill", seed=3, local=decode)
        agents.append(prefill)
        peer = prefill.call("add_peer", meta=decode.metadata(), warm=True)["peer"]
        num_layers = decode.registered_compat.num_layers
        last, every = 1 << (num_layers - 1), (1 << num_layers) - 1
        with pytest.raises(ValueError, match="2 layer masks for 3 reserved blocks"):
            decode.expect("a", 1, [20, 21, 22], deadline=time.time() + 60, sender="prefill", layer_masks=[1, 1])
        with pytest.raises(ValueError, match="must name some of the cache's"):
            decode.expect("a", 1, [20], deadline=time.time() + 60, sender="prefill", layer_masks=[0])
        decode.expect("a", 1, [20, 21], deadline=time.time() + 60, sender="prefill", layer_masks=[last, every])
        deadline = time.time() + 60
        prefill.call("write", peer=peer, req="a", epoch=1, src=[0], dst=[20], deadline=deadline,
                     layers=[num_layers - 1, num_layers])
        assert [e["type"] for e in wait_for(prefill, decode, 1, ("WriteDone", "WriteFailed"))] == ["WriteDone"]
        events = prefill.local_events + drain(decode, 0.05)
        prefill.local_events.clear()
        assert not [e for e in events if isinstance(e, Completed)], events
        prefill.call("write", peer=peer, req="a", epoch=1, src=[1], dst=[21], deadline=deadline)
        assert [e["type"] for e in wait_for(prefill, decode, 1, ("WriteDone", "WriteFailed"))] == ["WriteDone"]
        events = prefill.local_events + drain(decode, 0.5)
        assert [e.req for e in events if isinstance(e, Completed)] == ["a"], events
        expected = source_cache(seed=3)
        assert torch.equal(decode.kv_cache[20, :, num_layers - 1:], expected[0, :, num_layers - 1:])
        assert (decode.kv_cache[20, :, :num_layers - 1] == SENTINEL).all()  # never written, never awaited
        assert torch.equal(decode.kv_cache[21], expected[1])
    finally:
        decode.close()
