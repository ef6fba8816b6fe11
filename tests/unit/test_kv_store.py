"""The shared KV store (kv_store/) below the offload tiers: a prefix one engine computed
and evicted is loaded by another engine from the store, with the tokens a roomy engine
computes; a store that is gone, or bytes changed in it, cost only time (the engine
computes); only the deployment's clients get through; and the store's LRU, capacity and
directory log. The local launcher's store process started again on the port of one that
was killed (the supervisor's restart) serves the clients that knew the old one."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from cluster.config import ClusterConfig
from cluster.local.kv_store import StoreProcess, start_store
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.kv_cache import tier_io
from engine.kv_cache.events import SHARED
from engine.kv_cache.shared_tier import SharedBlock, StoreUnavailable
from engine.sampling_params import SamplingParams
from kv_store import KVStore, StoreClient, StoreServer
from kv_store.process import bind_store
from kv_store.server import BLOCK_OVERHEAD
from protocol import MessageError, encode
from protocol.kv_store import KV_STORE_MESSAGES, StoredBlock, StorePut, StoreSync
from security import DeploymentSecret
from tests.unit.test_kv_tiers import chat_turns, drain, gib

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=6, temperature=0)


def generate(core: EngineCore, prompts: list[list[int]], tag: str) -> tuple[list[list[int]], list[int]]:
    """Each prompt to its end, one after another: (tokens, cached tokens)."""
    tokens, cached = [], []
    for i, prompt in enumerate(prompts):
        request = core.add_request(f"{tag}{i}", prompt, GREEDY)
        deadline = time.monotonic() + 60
        while core.has_unfinished():
            assert time.monotonic() < deadline, "the engine did not finish"
            core.step()
        tokens.append(list(request.output_token_ids))
        cached.append(request.num_cached_tokens)
    return tokens, cached


def engine(llama_dir: Path, shared: StoreClient | None, blocks: int = 8) -> EngineCore:
    config = EngineConfig.from_options(str(llama_dir), num_kv_blocks=blocks, kv_offload_gib=gib(32))
    return EngineCore(config, shared_kv=shared)


def wait_for(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def settle(core: EngineCore, server: StoreServer) -> None:
    """Every block the engine offloaded is sealed and in the store."""
    drain(core.kv.tiers)
    wait_for(lambda: server.store.puts >= core.kv.tiers.shared.puts > 0, "the engine's puts did not land")


def computed_and_put(llama_dir: Path, server: StoreServer, prompts: list[list[int]]) -> list[list[int]]:
    """An engine (then closed) computes the prompts and a longer one that evicts them:
    their blocks are in the store. Its tokens for the prompts, then for that one."""
    a = engine(llama_dir, StoreClient(server.address, None))
    try:
        tokens, _ = generate(a, prompts + [[7] * 120], "a")
        settle(a, server)
    finally:
        a.close()
    return tokens


@contextmanager
def raw_socket(server: StoreServer) -> Iterator[zmq.Socket]:
    """A plain DEALER to the store: whatever bytes a test sends."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        yield sock
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
def server():
    s = StoreServer(64 << 20, "127.0.0.1").start()
    yield s
    s.stop()


def test_a_prefix_computed_by_one_engine_is_loaded_by_another(llama_dir: Path, server) -> None:
    """Engine B, which never saw the prompts (its own tiers are empty), loads the
    prefixes engine A computed and evicted from the store."""
    prompts = chat_turns(num_convs=4, num_turns=1)[0]
    roomy = EngineCore(EngineConfig.from_options(str(llama_dir), num_kv_blocks=200))
    try:
        want, _ = generate(roomy, prompts, "r")
    finally:
        roomy.close()
    a = engine(llama_dir, StoreClient(server.address, None))
    try:
        got, _ = generate(a, prompts, "a")
        assert got == want
        generate(a, [[7] * 120], "flush")  # evicts the last prompt's blocks too
        settle(a, server)
    finally:
        a.close()
    b_client = StoreClient(server.address, None)
    b = engine(llama_dir, b_client)
    try:
        wait_for(lambda: b_client.blocks() > 0, "engine B's directory stayed empty")
        got, cached = generate(b, prompts, "b")
        stats = b.stats().offload
    finally:
        b.close()
    assert got == want
    shared = {t.name: t for t in stats.tiers}["shared"]
    assert shared.hits > 0 and sum(cached) >= shared.hits * 16, (shared, cached)
    assert stats.failed_loads == 0
    # The store's usage, as its directory told B: its capacity in B's blocks, and at
    # least the blocks B's copy lists (each with its record) in use.
    capacity, used = b_client.usage()
    block_bytes = b.kv.tiers.block_bytes
    assert capacity == 64 << 20 and shared.capacity_blocks == capacity // block_bytes
    assert used >= shared.used_blocks * block_bytes > 0, (used, shared)


def test_a_prefix_is_in_the_store_while_the_engine_that_computed_it_still_holds_it(llama_dir: Path,
                                                                                   server) -> None:
    """Written through as it is cached: engine B loads the prefixes engine A computed
    while A, whose pool is large enough to evict nothing, is still serving."""
    prompts = chat_turns(num_convs=2, num_turns=1)[0]
    a = engine(llama_dir, StoreClient(server.address, None), blocks=200)
    b_client = StoreClient(server.address, None)
    b = engine(llama_dir, b_client)
    try:
        want, _ = generate(a, prompts, "a")
        assert a.kv.pool.num_free_blocks > 100  # nothing was evicted
        settle(a, server)
        wait_for(lambda: b_client.blocks() > 0, "engine B's directory stayed empty")
        got, cached = generate(b, prompts, "b")
        shared = {t.name: t for t in b.stats().offload.tiers}["shared"]
    finally:
        a.close()
        b.close()
    assert got == want
    assert shared.hits > 0 and sum(cached) >= shared.hits * 16, (shared, cached)


def test_blocks_invalidated_after_their_copy_leave_every_tier_and_the_store(llama_dir: Path, server) -> None:
    """A late remote write landing in a cached block makes its KV unknown: the copies
    already written through (host tier, store) go too, so nobody loads them."""
    a = engine(llama_dir, StoreClient(server.address, None), blocks=200)
    try:
        generate(a, chat_turns(num_convs=1, num_turns=1)[0], "a")
        settle(a, server)
        cached = [blk for blk in a.kv.pool.blocks if blk.block_hash is not None]
        hashes = [blk.block_hash for blk in cached]
        assert hashes and all(h in a.kv.tiers.host.entries for h in hashes)
        assert all(server.store.fetch(a.kv.tiers.io.seed, [h]) for h in hashes)
        bad = cached[len(cached) // 2:]
        a.invalidate_blocks([blk.block_id for blk in bad])
        gone = [h for h in hashes if h not in {blk.block_hash for blk in cached[:len(cached) // 2]}]
        assert not any(h in a.kv.tiers.host.entries for h in gone)
        wait_for(lambda: not any(server.store.fetch(a.kv.tiers.io.seed, [h]) for h in gone),
                 "the store still holds the invalidated blocks")
        assert all(server.store.fetch(a.kv.tiers.io.seed, [h]) for h in hashes if h not in gone)
    finally:
        a.close()


def test_a_prefix_asked_for_right_after_its_invalidation_is_computed(llama_dir: Path, server) -> None:
    """The same engine, the very next step: its copy of the store's directory must not
    find the revoked blocks, though the store has not yet been told (a load runs ahead of
    the I/O thread's drop; the review found it loading the bad bytes back 3 runs of 3)."""
    client = StoreClient(server.address, None, sync_interval_s=0.02)
    a = engine(llama_dir, client, blocks=200)
    prompt = chat_turns(num_convs=1, num_turns=1)[0][:1]
    try:
        generate(a, prompt, "a")
        settle(a, server)
        cached = [blk for blk in a.kv.pool.blocks if blk.block_hash is not None]
        wait_for(lambda: all(client.holds(blk.block_hash) for blk in cached), "the directory stayed behind")
        a.invalidate_blocks([blk.block_id for blk in cached])
        _, again = generate(a, prompt, "b")
        shared = {t.name: t for t in a.stats().offload.tiers}["shared"]
    finally:
        a.close()
    assert again == [0] and shared.hits == 0, (again, shared)


def test_a_drop_the_send_queue_has_no_room_for_waits_for_the_next_send(server,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """StoreDrop is never lost: one the queue toward the store has no room for goes with
    the client's next put, fetch or drop job (the review lost it 3 runs of 4)."""
    server.store.put(9, StoredBlock(block_hash=5, parent_hash=0, token_ids=[5], checksum=0), b"x" * 16)
    client = StoreClient(server.address, None)
    client.open(9)
    real = client._socket

    class Full:
        def send(self, *args, **kwargs):
            raise zmq.Again()

    try:
        monkeypatch.setattr(client, "_socket", lambda: Full())
        client.revoke([5])
        client.send_drops()  # no room: it waits
        time.sleep(0.2)
        assert server.store.fetch(9, [5])
        monkeypatch.setattr(client, "_socket", real)
        client.put(SharedBlock(5, 0, (5,), 0, b"y" * 16))  # a seal that ran as it was revoked: not put
        client.put(SharedBlock(6, 0, (6,), 0, b"y" * 16))
        wait_for(lambda: server.store.fetch(9, [6]), "the later put did not land")
        assert not server.store.fetch(9, [5]) and not client.holds(5)
    finally:
        client.close()


def test_a_fetch_answers_each_block_once_and_at_most_its_byte_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    store = KVStore(1 << 20)
    for h in (1, 2, 3):
        store.put(9, StoredBlock(block_hash=h, parent_hash=0, token_ids=[h], checksum=0), b"z" * 1000)
    assert [b.block_hash for b, _ in store.fetch(9, [1, 2, 1, 3])] == [1, 2]  # a repeat ends the chain
    monkeypatch.setattr("kv_store.server.MAX_ANSWER_BYTES", 2500)
    assert [b.block_hash for b, _ in store.fetch(9, [1, 2, 3])] == [1, 2]


def test_a_chain_longer_than_one_fetch_batch_loads_whole(llama_dir: Path, server,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads ask the store in batches of FETCH_BATCH_BYTES, each a round trip within
    the fetch timeout: a long prefix loads on a slow link too."""
    prompts = chat_turns(num_convs=2, num_turns=1)[0]
    want = computed_and_put(llama_dir, server, prompts)
    client = StoreClient(server.address, None)
    b = engine(llama_dir, client)
    monkeypatch.setattr(tier_io, "FETCH_BATCH_BYTES", 2 * b.kv.tiers.block_bytes)  # 2 blocks a round trip
    try:
        wait_for(lambda: client.blocks() > 0, "the directory stayed empty")
        got, cached = generate(b, prompts, "b")
        shared = {t.name: t for t in b.stats().offload.tiers}["shared"]
    finally:
        b.close()
    assert got == want[:len(prompts)]
    # Without batches one fetch per load (2); with them, at most 2 blocks per fetch.
    assert shared.hits > 2 and client.fetches >= -(-shared.hits // 2) > len(prompts), (shared, client.fetches)
    assert b.stats().offload.failed_loads == 0


def test_a_store_that_is_gone_costs_only_time(llama_dir: Path, server) -> None:
    prompts = chat_turns(num_convs=3, num_turns=1)[0]
    want = computed_and_put(llama_dir, server, prompts)
    client = StoreClient(server.address, None, fetch_timeout_s=0.3)
    b = engine(llama_dir, client)
    try:
        wait_for(lambda: client.blocks() > 0, "the directory stayed empty")
        server.stop()  # the store dies with B's directory of it still full
        got, _ = generate(b, prompts, "b")
        assert got == want[:-1]
        failed = b.stats().offload.failed_loads
        assert failed > 0  # B tried, waited at most the fetch timeout, and computed
        wait_for(lambda: client.blocks() == 0, "the directory outlived the store", timeout=15)
        assert generate(b, prompts, "later")[0] == want[:-1]
    finally:
        b.close()


def test_bytes_changed_in_the_store_are_refused(llama_dir: Path, server) -> None:
    prompts = chat_turns(num_convs=3, num_turns=1)[0]
    want = computed_and_put(llama_dir, server, prompts)
    for key, (block, data) in list(server.store._blocks.items()):
        server.store._blocks[key] = (block, bytes(len(data)))  # zeros, the same size
    b = engine(llama_dir, StoreClient(server.address, None))
    try:
        wait_for(lambda: b.kv.tiers.shared.blocks() > 0, "engine B's directory stayed empty")
        got, _ = generate(b, prompts, "b")
        stats = b.stats().offload
    finally:
        b.close()
    assert got == want[:-1]
    assert stats.failed_loads > 0 and {t.name: t for t in stats.tiers}["shared"].hits == 0


def test_only_the_deployments_clients_get_through(llama_dir: Path) -> None:
    secret, other = DeploymentSecret.new(), DeploymentSecret.new()
    s = StoreServer(1 << 20, "127.0.0.1", secret=secret).start()
    ours, theirs = StoreClient(s.address, secret), StoreClient(s.address, other, fetch_timeout_s=0.3)
    try:
        for c in (ours, theirs):
            c.open(5)
        block = SharedBlock(11, 0, (1, 2), 99, b"x" * 64)
        theirs.put(block)
        with pytest.raises(StoreUnavailable):
            theirs.fetch([11])
        assert s.store.used_bytes == 0
        ours.put(block)
        wait_for(lambda: ours.fetch([11]) != [], "our put did not land")
        assert bytes(ours.fetch([11])[0].data) == block.data
        wait_for(lambda: s.refused > 0, "the stranger was not refused")
    finally:
        ours.close()
        theirs.close()
        s.stop()


def test_the_store_refuses_bad_messages_and_keeps_serving(server) -> None:
    with raw_socket(server) as sock:
        sock.send(b"\x81\xa4kind\xa4nope")  # not one of the store's messages
        sock.send_multipart([encode(StoreSync(seq=1, namespace=1, since=0)), b"extra"])  # answered anyway
        assert sock.poll(5000)
        wait_for(lambda: server.refused >= 1, "the bad message was not counted")


def test_store_lru_capacity_and_directory_log() -> None:
    store = KVStore(capacity_bytes=3 * (10 + 8 + BLOCK_OVERHEAD))  # three blocks of 10 bytes and 1 token

    def put(h: int, ns: int = 1) -> str | None:
        return store.put(ns, StoredBlock(block_hash=h, parent_hash=0, token_ids=[h], checksum=0), bytes(10))

    for h in (1, 2, 3):
        assert put(h) is None
    assert [b.block_hash for b, _ in store.fetch(1, [1, 2, 9, 3])] == [1, 2]  # a chain stops at a miss
    put(4)  # evicts 3, the least recently used
    assert store.changes(1, 0) == (True, [1, 2, 4], [])
    v = store.version
    put(5)  # evicts 1
    assert store.changes(1, v) == (False, [5], [1])
    assert store.changes(1, store.version) == (False, [], [])
    assert store.changes(1, store.version + 7)[0]  # a version from before a restart: start over
    assert "bytes" in store.put(1, StoredBlock(block_hash=6, parent_hash=0, token_ids=[], checksum=0), bytes(9))
    assert store.changes(2, 0) == (False, [], [])  # another namespace sees none of it


def test_blocks_the_store_lost_since_the_last_sync_are_computed_and_forgotten(llama_dir: Path, server) -> None:
    prompts = chat_turns(num_convs=3, num_turns=1)[0]
    want = computed_and_put(llama_dir, server, prompts)
    client = StoreClient(server.address, None, sync_interval_s=30.0)  # one sync, then none in the test's time
    b = engine(llama_dir, client)
    try:
        _, added, _ = server.store.changes(b.kv.tiers.io.seed, 0)
        client._held = set(added)  # the directory as a sync just brought it
        server.store._blocks.clear()  # then the store lost them all (as a restart would)
        got, _ = generate(b, prompts, "b")
        stats = b.stats().offload
    finally:
        b.close()
    assert got == want[:-1]
    assert stats.failed_loads > 0 and {t.name: t for t in stats.tiers}["shared"].hits == 0
    assert len(client._held) < len(added)  # what a fetch missed is not looked for again


def test_the_directory_copy_reports_its_changes_as_shared_tier_events(llama_dir: Path, server) -> None:
    """What the router's kv_aware index learns of the store (engine/kv_cache/events.py)."""
    prompts = chat_turns(num_convs=3, num_turns=1)[0]
    computed_and_put(llama_dir, server, prompts)
    client = StoreClient(server.address, None, fetch_timeout_s=0.3)
    b = engine(llama_dir, client)
    try:
        b.collect_kv_events(4)
        wait_for(lambda: client.blocks() > 0, "the directory stayed empty")
        events, lost = b.take_kv_events()
        held = {h for h, tier, stored in events if tier == SHARED and stored}
        assert not lost and held == client._held and held <= {h for _, h in server.store._blocks}
        server.stop()
        wait_for(lambda: client.blocks() == 0, "the directory outlived the store", timeout=15)
        events, _ = b.take_kv_events()
        assert {h for h, tier, stored in events if tier == SHARED and not stored} == held
    finally:
        b.close()


def test_a_message_nested_too_deep_is_refused_and_the_store_serves_on(server) -> None:
    with raw_socket(server) as sock:
        # A map whose first value is a list in a list ... 2,000 deep: skipping it (the
        # tag comes after) recurses past the interpreter's limit.
        sock.send(b"\x82\xa2zz" + b"\x91" * 2000 + b"\x00\xa4kind\xaastore_sync")
        sock.send(encode(StoreSync(seq=2, namespace=1, since=0)))
        assert sock.poll(5000), "the store stopped answering"
        assert KV_STORE_MESSAGES.decode(sock.recv()).seq == 2
        wait_for(lambda: server.refused >= 1, "the nested message was not counted")


def test_after_a_fetch_times_out_the_next_fails_at_once(server) -> None:
    client = StoreClient(server.address, None, fetch_timeout_s=0.3, sync_interval_s=60.0)
    client.open(1)
    try:
        server.stop()
        for waited in (0.25, 0.0):  # the first waits its timeout; a load queued behind it does not
            start = time.monotonic()
            with pytest.raises(StoreUnavailable):
                client.fetch([1])
            assert waited <= time.monotonic() - start < waited + 0.2
        assert not client.holds(1)
    finally:
        client.close()


def test_a_block_put_again_replaces_its_bytes_and_is_announced_again(server) -> None:
    client = StoreClient(server.address, None, sync_interval_s=0.02)
    client.open(9)
    try:
        client.put(SharedBlock(5, 0, (1,), 0, b"bad!" * 4))
        wait_for(lambda: client.holds(5), "the block was not announced")
        client.forget([5])  # a fetch of it failed its check
        client.put(SharedBlock(5, 0, (1,), 0, b"good" * 4))
        wait_for(lambda: client.holds(5), "the block put again was not announced again")
        assert bytes(client.fetch([5])[0].data) == b"good" * 4
    finally:
        client.close()


def test_a_store_restarted_at_the_same_address_replaces_the_copy() -> None:
    first = StoreServer(1 << 20, "127.0.0.1").start()
    port = int(first.address.rpartition(":")[2])
    client = StoreClient(first.address, None, sync_interval_s=0.02)
    client.open(9)
    second = None
    try:
        for h in (101, 102, 103):
            client.put(SharedBlock(h, 0, (h,), 0, b"x" * 16))
        wait_for(lambda: client.blocks() == 3, "the first store's blocks were not announced")
        first.stop()
        second = StoreServer(1 << 20, "127.0.0.1", port).start()
        for h in (201, 202, 203, 204):  # its version passes the client's before the client notices
            second.store.put(9, StoredBlock(block_hash=h, parent_hash=0, token_ids=[h], checksum=0), b"y" * 16)
        wait_for(lambda: client.holds(201) and not client.holds(101), "the copy is still the first store's")
    finally:
        client.close()
        if second is not None:
            second.stop()


def test_capacity_counts_each_blocks_record() -> None:
    store = KVStore(capacity_bytes=5000)
    many = StoredBlock(block_hash=1, parent_hash=0, token_ids=list(range(1000)), checksum=0)
    assert store.put(1, many, bytes(10)) is not None and store.used_bytes == 0
    with pytest.raises(MessageError, match="length"):
        KV_STORE_MESSAGES.decode(encode(StorePut(namespace=1, block=StoredBlock(
            block_hash=1, parent_hash=0, token_ids=[1] * 1025, checksum=0))))


def store_config(llama_dir: Path) -> ClusterConfig:
    return ClusterConfig.from_dict({"model": str(llama_dir), "kv_store": {"enabled": True, "capacity_gib": gib(8)},
                                    "decode": {"engine": {"kv_offload_gib": gib(2)}}})


def holding(host: str, port: int) -> socket.socket:
    """A listening socket on the port: ZMQ's bind, SO_REUSEADDR or not, fails while it is open."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the killed store's TIME_WAIT connections
    s.bind((host, port))
    s.listen()
    return s


def put_until_held(client: StoreClient, block: SharedBlock, timeout: float = 15.0) -> None:
    """Put it until the client's directory copy has it (puts before its reconnection may be lost)."""
    deadline = time.monotonic() + timeout
    while not client.holds(block.block_hash):
        assert time.monotonic() < deadline, "the client's puts do not reach the store"
        client.put(block)
        time.sleep(0.1)


@pytest.mark.timeout(90)
def test_a_store_started_on_a_killed_stores_port_serves_its_clients(llama_dir: Path) -> None:
    """start_store on the port of a killed store process: it waits out the port held a
    moment, and a client of the old store reconnects on its own, takes the new one's
    directory, and puts and fetches there."""
    config, secret = store_config(llama_dir), DeploymentSecret.new()
    first = start_store(config, secret)
    stores: list[StoreProcess] = [first]
    client = StoreClient(first.address, secret, sync_interval_s=0.05, fetch_timeout_s=1.0)
    client.open(9)
    try:
        client.put(SharedBlock(101, 0, (101,), 0, b"x" * 16))
        wait_for(lambda: client.holds(101), "the first store's block was not announced")
        first.process.kill()
        first.process.join(10)
        held = holding(first.host, first.port)
        threading.Timer(0.5, held.close).start()
        start = time.monotonic()
        stores.append(start_store(config, secret, first.host, first.port))
        assert stores[1].address == first.address and time.monotonic() - start >= 0.4  # it waited for the port
        put_until_held(client, SharedBlock(102, 0, (102,), 0, b"y" * 16))
        assert not client.holds(101)  # the copy is the new store's
        assert bytes(client.fetch([102])[0].data) == b"y" * 16
    finally:
        client.close()
        for store in stores:
            store.stop()


@pytest.mark.timeout(60)
def test_a_store_whose_port_stays_taken_fails_to_start_after_its_bind_timeout(llama_dir: Path) -> None:
    held = holding("127.0.0.1", 0)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="exited as it started"):
            start_store(store_config(llama_dir), None, "127.0.0.1", held.getsockname()[1], bind_timeout_s=0.5)
        assert 0.5 <= time.monotonic() - start < 20
    finally:
        held.close()


@pytest.mark.timeout(60)
def test_bind_store_on_a_port_in_use_gives_up_every_time() -> None:
    """Each try that finds the port in use is closed before the next: a failed server's
    context left to the collector waited for its sockets forever, and a store restarted
    on a held port hung instead of failing (repro f5; CI: 'did not start in 30 s')."""
    held = holding("127.0.0.1", 0)
    failed: list[zmq.ZMQError] = []

    def bind() -> None:
        try:
            bind_store(1 << 20, "127.0.0.1", held.getsockname()[1], DeploymentSecret.new(), 0.2)
        except zmq.ZMQError as exc:
            failed.append(exc)

    try:
        for attempt in range(10):
            thread = threading.Thread(target=bind, daemon=True)
            thread.start()
            thread.join(10)
            assert not thread.is_alive(), f"bind_store hung (attempt {attempt})"
        assert len(failed) == 10 and all(e.errno == zmq.EADDRINUSE for e in failed)
    finally:
        held.close()


def test_kv_a_remote_prefill_wrote_is_not_written_through_again_but_offloaded_when_evicted(
        llama_dir: Path, server) -> None:
    """A decode worker's prompt blocks came from a prefill worker, which wrote them through
    itself: copying them to the host tier and the store again as they arrive cost every
    remote prefill its blocks' copy (no-reuse TTFT 0.92x). The blocks it computes are
    written through; the arrived ones still go to the host tier when evicted."""
    b = engine(llama_dir, StoreClient(server.address, None), blocks=12)
    prompt = list(range(1, 16 * 4 + 2))  # 4 full blocks, then one token
    try:
        request = b.add_remote_prefill_request("r", prompt, SamplingParams(max_tokens=20, temperature=0.0))
        assert request is not None
        b.remote_kv_arrived("r")
        arrived = [blk.block_hash for blk in b.kv.pool.blocks if blk.block_hash is not None]
        assert len(arrived) == 4
        drain(b.kv.tiers)
        assert not b.kv.tiers.host.entries and b.kv.tiers.shared.puts == 0
        while b.has_unfinished():
            b.step()
        drain(b.kv.tiers)
        computed = [blk.block_hash for blk in b.kv.pool.blocks if blk.block_hash not in (None, *arrived)]
        assert computed and set(b.kv.tiers.host.entries) == set(computed)  # written through as computed
        generate(b, [[7] * 170], "flush")  # 11 blocks of 12: the arrived ones are evicted, but the first
        drain(b.kv.tiers)
        evicted = set(arrived) - {blk.block_hash for blk in b.kv.pool.blocks}
        assert len(evicted) >= 3 and evicted <= set(b.kv.tiers.host.entries)
    finally:
        b.close()
