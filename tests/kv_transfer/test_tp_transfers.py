"""Writes between workers of different TP sizes (one process, shm, tcp and nixl): every
destination rank ends up holding exactly the heads it owns of the source blocks, no
other block changes, the receiver hears of a write only once all of it landed, the
descriptors are the plan's; impossible pairings and rank caches that do not form a
worker are refused, saying why."""

from __future__ import annotations

import importlib
import mmap
import os
import time
import uuid
from collections.abc import Callable, Iterator

import msgpack
import pytest
import torch
import zmq

from kv_transfer import IncompatiblePeerError, KVTransport, Received, TransportConfig, WriteDone, create_transport
from kv_transfer.rank_pairs import even_head_ranges
from kv_transfer.shm_segments import SHM_DIR
from protocol import encode
from protocol.kv_control import Written

SENTINEL = -7.0
BLOCKS, LAYERS, BLOCK_SIZE, HEAD_DIM = 32, 2, 4, 8
# (src blocks, dst blocks) per write: one run of 6 blocks; 3 blocks consecutive on neither side
WRITES = [([0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]), ([20, 9, 3], [2, 30, 7])]
RUNS, WRITTEN = 1 + 3, 6 + 3


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


NIXL = pytest.param("nixl", marks=pytest.mark.skipif(not _importable("nixl._api"),
                                                     reason="the nixl transport needs the nixl package"))
# The transports that move KV between TP sizes (nixl on CPU caches).
MULTI_RANK = ["shm", "tcp", NIXL]
FILE_BACKED = ("shm", "nixl")  # caches in /dev/shm files, as a TP worker's engine makes them on CPU


class Worker:
    """A TP worker's driver as the transport sees it: one cache per rank (in its own
    /dev/shm file for shm and nixl, as the engine makes them), registered together."""

    def __init__(self, transport: str, name: str, kv_heads: int, tp: int, files: list[str], planes: int = 2) -> None:
        self.t = create_transport(transport, name, TransportConfig(timeout_s=5.0, cancel_grace_s=5.0))
        self.ranges = even_head_ranges(kv_heads, tp)
        self.caches, paths = [], []
        for start, end in self.ranges:
            shape = (BLOCKS, end - start, LAYERS, planes, BLOCK_SIZE, HEAD_DIM)
            if transport in FILE_BACKED:
                cache, path = shm_cache(shape)
                files.append(path)
                paths.append(path)
            else:
                cache = torch.empty(shape)
            cache.fill_(SENTINEL)
            self.caches.append(cache)
        self.t.register_kv_cache(self.caches, "test-model", kv_heads, self.ranges, paths or None)


def shm_cache(shape: tuple[int, ...]) -> tuple[torch.Tensor, str]:
    path = os.path.join(SHM_DIR, f"pdserve-kv-test-{uuid.uuid4().hex}")
    size = torch.Size(shape).numel() * 4
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return torch.frombuffer(m, dtype=torch.float32).view(shape), path


@pytest.fixture
def make() -> Iterator:
    made: list[Worker] = []
    files: list[str] = []

    def worker(transport: str, name: str, kv_heads: int, tp: int, planes: int = 2) -> Worker:
        made.append(Worker(transport, name, kv_heads, tp, files, planes))
        return made[-1]

    yield worker
    for w in made:
        w.t.close()
    assert all(os.path.exists(f) for f in files), "the transport removed a cache file it did not make"
    for f in files:
        os.unlink(f)


def poll_until_done(sender: KVTransport, receiver: KVTransport, count: int,
                    on_received: Callable[[Received], None] = lambda e: None) -> list:
    """The sender's events until `count` writes ended; on_received sees each Received
    of the receiver's as soon as its poll() reports it."""
    events, end = [], time.monotonic() + 10
    while len([e for e in events if type(e).__name__ in ("WriteDone", "WriteFailed")]) < count:
        assert time.monotonic() < end, f"writes never ended: {events}"
        events += sender.poll()
        for e in receiver.poll():
            if isinstance(e, Received):
                on_received(e)
        time.sleep(0.002)
    return events


# (kv heads, prefill TP, decode TP, descriptors of WRITES): a piece that is every head of
# the block on both sides is one descriptor per run (RUNS), any other one per block (WRITTEN).
PAIRINGS = [
    (2, 1, 1, RUNS),  # homogeneous: one rank pair, whole
    (2, 2, 2, 2 * RUNS),  # homogeneous: two rank pairs, whole
    (2, 1, 2, 2 * WRITTEN),  # each decode rank takes one head of the prefill rank's two
    (2, 2, 1, 2 * WRITTEN),  # the decode rank takes one head from each prefill rank
    (1, 1, 2, 2 * RUNS),  # one KV head, replicated at TP 2: each rank gets it whole
    (1, 2, 1, RUNS),  # replicated at the source: read once, from rank 0
    (1, 2, 2, 2 * RUNS),
    (4, 1, 4, 4 * WRITTEN),
    (4, 4, 2, 4 * WRITTEN),
    (4, 2, 4, 4 * WRITTEN),
]
# An MLA latent cache (one plane, one "head" every rank holds whole): whole blocks, each
# destination rank's from one source rank, between any TP sizes.
LATENT_PAIRINGS = [(1, 1, 2, 2 * RUNS), (1, 2, 1, RUNS), (1, 2, 2, 2 * RUNS), (1, 1, 1, RUNS)]


def reserved_pair(make, transport: str, kv_heads: int, p: int, d: int,
                  planes: int) -> tuple[torch.Tensor, Worker, Worker]:
    """(the "global" cache, decode worker at TP d, prefill worker at TP p holding its
    ranks' heads of it), joined, with a reservation r{i} for each of WRITES."""
    g = torch.Generator().manual_seed(kv_heads * 100 + p * 10 + d)
    whole = torch.randn(BLOCKS, kv_heads, LAYERS, planes, BLOCK_SIZE, HEAD_DIM, generator=g)
    decode = make(transport, "decode", kv_heads, d, planes)
    prefill = make(transport, "prefill", kv_heads, p, planes)
    for (start, end), cache in zip(prefill.ranges, prefill.caches):
        cache.copy_(whole[:, start:end])
    assert prefill.t.add_peer(decode.t.metadata()) == "decode"
    for i, (_, dst) in enumerate(WRITES):
        decode.t.expect(f"r{i}", 1, dst, deadline=time.time() + 60, sender="prefill")
    return whole, decode, prefill


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", MULTI_RANK)
@pytest.mark.parametrize("kv_heads,p,d,descriptors,planes", [(*pairing, 2) for pairing in PAIRINGS]
                         + [(*pairing, 1) for pairing in LATENT_PAIRINGS])
def test_each_decode_rank_gets_exactly_its_heads(make, transport: str, kv_heads: int, p: int, d: int,
                                                 descriptors: int, planes: int) -> None:
    whole, decode, prefill = reserved_pair(make, transport, kv_heads, p, d, planes)
    for i, (src, dst) in enumerate(WRITES):
        prefill.t.write("decode", f"r{i}", 1, src, dst, deadline=time.time() + 60)
    received: list[str] = []

    def landed_before_heard(e: Received) -> None:  # every piece of the write, on every rank
        src, dst = WRITES[int(e.req[1:])]
        assert sorted(e.blocks) == sorted(dst)
        for r, ((start, end), cache) in enumerate(zip(decode.ranges, decode.caches)):
            assert torch.equal(cache[dst], whole[src, start:end]), f"{e.req} heard of before rank {r}'s heads landed"
        received.append(e.req)

    events = poll_until_done(prefill.t, decode.t, len(WRITES), landed_before_heard)
    assert all(isinstance(e, WriteDone) for e in events if type(e).__name__.startswith("Write")), events
    assert sorted(received) == [f"r{i}" for i in range(len(WRITES))]

    written = sorted(b for _, dst in WRITES for b in dst)
    for r, ((start, end), cache) in enumerate(zip(decode.ranges, decode.caches)):
        for src, dst in WRITES:
            assert torch.equal(cache[dst], whole[src, start:end]), f"decode rank {r}'s heads [{start}, {end})"
        untouched = [b for b in range(BLOCKS) if b not in written]
        assert (cache[untouched] == SENTINEL).all(), f"decode rank {r}: a block nobody wrote to changed"
    head_bytes = LAYERS * planes * BLOCK_SIZE * HEAD_DIM * 4
    assert prefill.t.stats["descriptors"] == descriptors
    moved = sum(end - start for start, end in decode.ranges)  # replicated heads once per rank
    assert prefill.t.stats["bytes_written"] == WRITTEN * moved * head_bytes
    assert decode.t.stats["late_writes_dropped"] == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", MULTI_RANK)
def test_impossible_pairings_are_refused_with_the_reason(make, transport: str) -> None:
    decode = make(transport, "decode", 4, 2)
    other_heads = make(transport, "prefill", 2, 2)
    with pytest.raises(IncompatiblePeerError, match="num_kv_heads is 4 there, 2 here"):
        other_heads.t.add_peer(decode.t.metadata())
    prefill = make(transport, "prefill2", 4, 1)
    for ranges, tp, reason in [([[0, 2], [0, 2]], 2, r"no rank holds KV heads \[2, 3\] of 4"),
                               ([[0, 2], [2, 3], [3, 4]], 3, "4 KV heads do not divide over TP 3"),
                               ([[0, 2], [2, 4]], 3, "tp_size 3 but 2 head ranges")]:
        meta = msgpack.unpackb(decode.t.metadata(), raw=False)
        meta["compat"].update(head_ranges=ranges, tp_size=tp)
        with pytest.raises(IncompatiblePeerError, match=reason):
            prefill.t.add_peer(msgpack.packb(meta, use_bin_type=True))
    assert not prefill.t.control.peers


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", MULTI_RANK)
def test_an_mla_worker_and_a_per_head_worker_are_refused_as_a_pair(make, transport: str) -> None:
    latent, dense = make(transport, "decode", 1, 2, planes=1), make(transport, "prefill", 1, 1)
    with pytest.raises(IncompatiblePeerError, match="its KV cache is MLA latent, this worker's per-head K/V"):
        dense.t.add_peer(latent.t.metadata())
    with pytest.raises(IncompatiblePeerError, match="its KV cache is per-head K/V, this worker's MLA latent"):
        latent.t.add_peer(dense.t.metadata())
    assert not dense.t.control.peers and not latent.t.control.peers


@pytest.mark.timeout(30)
def test_a_write_whose_pieces_leave_heads_unwritten_is_refused(make) -> None:
    decode = make("shm", "decode", 4, 2)
    sock = decode.t.control.ctx.socket(zmq.DEALER)
    try:
        decode.t.expect("a", 1, [2, 3], deadline=time.time() + 60, sender="prefill")
        sock.setsockopt(zmq.ROUTING_ID, b"prefill")
        sock.connect(decode.t.control_address)
        sock.send(encode(Written(xfer=1, req="a", epoch=1, blocks=[2, 3], runs=[(2, 2)],
                                 pieces=[(0, 0, 2, 1)])))  # rank 1's heads never written
        end = time.monotonic() + 5
        while not sock.poll(10):
            assert time.monotonic() < end, "no reply to the write"
            assert not [e for e in decode.t.poll() if type(e).__name__ in ("Received", "Completed")]
        reply = msgpack.unpackb(sock.recv(), raw=False)
        assert reply["kind"] == "ack" and not reply["ok"]
        assert "pieces do not fill every head" in reply["reason"] and "rank 1" in reply["reason"]
    finally:
        sock.close(0)


def refusal(decode: Worker, pieces: list[list[int]], frames: list[bytes]) -> str:
    """Send D a write of blocks [2, 3] with `pieces` and data `frames` straight from a
    socket; the reason of its refusal ("" if it accepted it)."""
    sock = decode.t.control.ctx.socket(zmq.DEALER)
    try:
        decode.t.expect("a", 1, [2, 3], deadline=time.time() + 60, sender="prefill")
        sock.setsockopt(zmq.ROUTING_ID, b"prefill")
        sock.connect(decode.t.control_address)
        sock.send_multipart([encode(Written(xfer=1, req="a", epoch=1, blocks=[2, 3], runs=[(2, 2)],
                                            pieces=[tuple(p) for p in pieces])), *frames])
        end = time.monotonic() + 5
        while not sock.poll(10):
            assert time.monotonic() < end, "no reply to the write"
            decode.t.poll()
        reply = msgpack.unpackb(sock.recv(), raw=False)
        assert reply["kind"] == "ack"
        return reply["reason"]
    finally:
        sock.close(0)
        decode.t.abort("a")
        decode.t.poll()


@pytest.mark.timeout(30)
def test_tcp_refuses_data_that_does_not_match_the_pieces(make) -> None:
    decode = make("tcp", "decode", 4, 2)
    head = LAYERS * 2 * BLOCK_SIZE * HEAD_DIM * 4
    # every head of both ranks, per block: 2 pieces x 2 blocks
    assert "need 4 data frames, got 3" in refusal(decode, [[0, 0, 2, 0], [1, 0, 2, 0]], [b"x" * 2 * head] * 3)
    assert "2 heads of a block came with" in refusal(decode, [[0, 0, 2, 0], [1, 0, 2, 0]], [b"x" * head] * 4)
    assert "a run of 2 blocks came with" in refusal(decode, [[0, 0, 2, 1], [1, 0, 2, 1]], [b"x" * head] * 2)
    assert (decode.caches[0] == SENTINEL).all()
    assert refusal(decode, [[0, 0, 2, 1], [1, 0, 1, 0], [1, 1, 1, 0]],
                   [b"\0" * 4 * head, b"\0" * head, b"\0" * head, b"\0" * head, b"\0" * head]) == ""
    assert (decode.caches[0][[2, 3]] == 0).all() and (decode.caches[1][[2, 3]] == 0).all()
    assert (decode.caches[1][[0, 1, 4]] == SENTINEL).all()


def rank_caches(ranges: list[tuple[int, int]], blocks: list[int] | None = None) -> list[torch.Tensor]:
    blocks = blocks or [BLOCKS] * len(ranges)
    return [torch.zeros(n, e - s, LAYERS, 2, BLOCK_SIZE, HEAD_DIM) for (s, e), n in zip(ranges, blocks)]


@pytest.mark.parametrize("caches,kv,ranges,files,message", [
    (rank_caches([(0, 2), (2, 4)], [BLOCKS, 16]), 4, [(0, 2), (2, 4)], None,
     "rank 1's cache has num_blocks 16, rank 0's 32"),
    (rank_caches([(0, 2), (2, 4)]), 4, [(0, 2), (1, 3)], None, r"no rank holds KV heads \[3\]"),
    (rank_caches([(0, 2), (2, 4)]), 4, [(0, 2)], None, "2 rank caches but 1 head ranges"),
    (rank_caches([(0, 1), (1, 2)]), 2, [(0, 1), (1, 3)], None, r"rank 1 holds heads \[1, 3\), outside \[0, 2\)"),
    (rank_caches([(0, 2), (2, 3)]), 3, [(0, 2), (2, 3)], None, "3 KV heads do not divide over TP 2"),
    (rank_caches([(0, 1), (1, 2)]), 4, [(0, 2), (2, 4)], None, r"rank 0 holds heads \[0, 2\) but its cache has 1"),
    (rank_caches([(0, 2), (2, 4)]), None, None, None, "say num_kv_heads and each rank's head_ranges"),
    (rank_caches([(0, 2), (2, 4)]), 4, [(0, 2), (2, 4)], ["/dev/shm/x"], "2 rank caches need as many file paths"),
    ([torch.zeros(BLOCKS, LAYERS, 2, BLOCK_SIZE, 2, HEAD_DIM)], 2, [(0, 2)], None,
     r"expected a block_major:\[blocks,kv_heads,layers,2,block_size,head_dim\] or"),
    ([torch.zeros(BLOCKS, 2, LAYERS, 1, BLOCK_SIZE, HEAD_DIM)], 2, [(0, 2)], None,
     r"a latent \(one-plane\) cache holds one KV head, not 2"),
    ([torch.zeros(BLOCKS, 1, LAYERS, 1, BLOCK_SIZE, HEAD_DIM), torch.zeros(BLOCKS, 1, LAYERS, 2, BLOCK_SIZE, HEAD_DIM)],
     1, [(0, 1), (0, 1)], None, "rank 1's cache has planes 2, rank 0's 1"),
])
def test_rank_caches_that_do_not_form_a_worker_are_refused(caches, kv, ranges, files, message) -> None:
    t = create_transport("tcp", "decode")
    try:
        with pytest.raises(ValueError, match=message):
            t.register_kv_cache(caches, "test-model", kv, ranges, files)
        assert t.compat is None and t.kv_cache is None
    finally:
        t.close()


def test_shm_needs_the_files_of_rank_caches_it_did_not_allocate(make) -> None:
    t = create_transport("shm", "decode")
    try:
        with pytest.raises(ValueError, match="rank caches with the /dev/shm files that hold them"):
            t.register_kv_cache(rank_caches([(0, 2), (2, 4)]), "test-model", 4, [(0, 2), (2, 4)])
        cache, path = shm_cache((BLOCKS, 2, LAYERS, 2, BLOCK_SIZE, HEAD_DIM))
        _, small = shm_cache((BLOCKS, 1, LAYERS, 2, BLOCK_SIZE, HEAD_DIM))
        try:
            with pytest.raises(ValueError, match=f"rank 1's cache file {small} holds {cache.nbytes // 2} bytes, "
                                                 f"its cache {cache.nbytes}"):
                t.register_kv_cache([cache, torch.zeros(BLOCKS, 2, LAYERS, 2, BLOCK_SIZE, HEAD_DIM)],
                                    "test-model", 4, [(0, 2), (2, 4)], [path, small])
        finally:
            os.unlink(path)
            os.unlink(small)
    finally:
        t.close()


@pytest.mark.parametrize("transport", ["nccl", "cuda_ipc"])
def test_transports_without_tp_refuse_rank_caches_and_tp_peers(make, transport: str) -> None:
    t = create_transport(transport, "decode")
    try:
        with pytest.raises(ValueError, match=f"the {transport} transport cannot register 2 rank caches: KV "
                                             f"transfers between TP>1 workers are not built for {transport} yet"):
            t.register_kv_cache(rank_caches([(0, 2), (2, 4)]), "test-model", 4, [(0, 2), (2, 4)])
        if transport == "cuda_ipc":
            return  # a TP 1 cache needs a GPU
        t.register_kv_cache(torch.zeros(BLOCKS, 4, LAYERS, 2, BLOCK_SIZE, HEAD_DIM), "test-model")
        meta = msgpack.unpackb(t.metadata(), raw=False)
        meta["name"] = "peer"
        meta["compat"].update(head_ranges=[[0, 2], [2, 4]], tp_size=2)
        with pytest.raises(IncompatiblePeerError, match=f"peer 'peer' is at TP 2: the {transport} transport"):
            t.add_peer(msgpack.packb(meta, use_bin_type=True))
    finally:
        t.close()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _importable("nixl._api"), reason="the nixl transport needs the nixl package")
def test_nixl_refuses_peers_it_cannot_describe_and_connects_once_they_are_right(make) -> None:
    decode, prefill = make("nixl", "decode", 4, 2), make("nixl", "prefill", 4, 1)
    good = decode.t.metadata()
    for change, reason in [(dict(bases=[1 << 40]), r"announced cache bases \[1099511627776\] for its 2 ranks"),
                           (dict(bases=[1 << 40, 1 << 41]), "'decode''s caches are not where it announced them"),
                           (dict(mem="VRAM"), "moving KV between TP sizes .* over nixl is built for CPU caches only")]:
        meta = msgpack.unpackb(good, raw=False)
        meta["data"].update(change)
        with pytest.raises(IncompatiblePeerError, match=reason):
            prefill.t.add_peer(msgpack.packb(meta, use_bin_type=True))
    assert not prefill.t.control.peers
    # Nothing of the refused handshakes stands in the way: the right one connects, and a
    # write lands.
    assert prefill.t.add_peer(good) == "decode"
    for cache in prefill.caches:
        cache.fill_(3.0)
    decode.t.expect("a", 1, [5, 6], deadline=time.time() + 60, sender="prefill")
    prefill.t.write("decode", "a", 1, [1, 2], [5, 6], deadline=time.time() + 60)
    assert all(isinstance(e, WriteDone) for e in poll_until_done(prefill.t, decode.t, 1)
               if type(e).__name__.startswith("Write"))
    assert all((c[[5, 6]] == 3.0).all() and (c[[1, 2, 7]] == SENTINEL).all() for c in decode.caches)
