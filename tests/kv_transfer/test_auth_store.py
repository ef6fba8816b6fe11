"""The nccl transport's authenticated rendezvous store (kv_transfer/auth_store.py): a
torch Store with the semantics gloo and NCCL rely on, usable from many threads, that
a process without the deployment's secret can neither read nor write."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import torch
from torch.distributed import DistStoreError, PrefixStore, ProcessGroupGloo, TCPStore

from kv_transfer import IncompatiblePeerError
from kv_transfer.auth_store import AuthStore, StoreServer
from security import DeploymentSecret
from tests.kv_transfer.agent import cpu_agent

SECRET = DeploymentSecret.new()


@pytest.fixture
def server() -> Iterator[StoreServer]:
    s = StoreServer("127.0.0.1", SECRET, "test")
    yield s
    s.close()


@pytest.fixture
def stores(server: StoreServer) -> Iterator[list[AuthStore]]:
    made = [AuthStore(server.address, SECRET, 5.0) for _ in range(2)]
    yield made
    for s in made:
        s.close()


def test_the_store_verbs_torch_uses(stores: list[AuthStore]) -> None:
    a, b = stores
    p = PrefixStore("pair", a)  # as the transport and gloo reach it: through C++
    p.set("k", b"v")
    assert b.get("pair/k") == b"v" and p.get("k") == b"v"
    assert [p.add("n", 2), p.add("n", 3)] == [2, 5] and p.get("n") == b"5"
    assert p.compare_set("c", b"", b"x") == b"x"  # absent, expected empty: set
    assert p.compare_set("c", b"y", b"z") == b"x"  # present, not as expected: unchanged
    assert p.compare_set("c", b"x", b"z") == b"z"
    assert p.compare_set("absent", b"e", b"d") == b"e"
    assert p.check(["k", "n"]) and not p.check(["k", "absent"])
    assert p.num_keys() == 3 and b.num_keys() == 3
    assert p.delete_key("c") and not p.delete_key("c") and p.num_keys() == 2
    p.append("l", b"ab")
    p.append("l", b"cd")
    p.multi_set(["m1", "m2"], [b"1", b"2"])
    assert p.multi_get(["l", "m1", "m2"]) == [b"abcd", b"1", b"2"]
    p.wait(["k", "m1"])
    p.wait(["k"], datetime.timedelta(seconds=1))


def test_a_blocking_call_is_answered_when_its_key_arrives(stores: list[AuthStore]) -> None:
    a, b = stores
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(a.get("later")))
    waiter.start()
    time.sleep(0.3)
    assert not got  # still waiting, not refused
    b.set("later", b"here")
    waiter.join(5)
    assert got == [b"here"]


def test_a_call_past_its_timeout_fails_and_the_store_goes_on(stores: list[AuthStore]) -> None:
    a, b = stores
    start = time.monotonic()
    with pytest.raises(DistStoreError, match=r"did not answer wait \['never'\] within 0.3 s"):
        a.wait(["never"], datetime.timedelta(seconds=0.3))
    assert 0.3 <= time.monotonic() - start < 2
    a.set_timeout(datetime.timedelta(seconds=0.2))
    with pytest.raises(DistStoreError, match="within 0.2 s"):
        a.get("never")
    b.set("never", b"now")  # a reply that might still come is not taken for the next call's
    assert a.add("x", 1) == 1 and a.get("never") == b"now"


def test_calls_from_many_threads_at_once(stores: list[AuthStore]) -> None:
    a, _ = stores
    errors: list[BaseException] = []

    def count() -> None:
        try:
            for _ in range(50):
                a.add("count", 1)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=count) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and a.get("count") == b"400"


def test_closing_the_store_ends_a_call_in_progress(server: StoreServer) -> None:
    store = AuthStore(server.address, SECRET, 30.0)
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            store.get("never")
        except DistStoreError as exc:
            failed.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    store.close()
    waiter.join(2)
    assert not waiter.is_alive() and "was closed during get" in str(failed[0])
    with pytest.raises(DistStoreError, match="is closed"):
        store.set("k", b"v")


def test_a_gloo_pair_meets_through_it(stores: list[AuthStore]) -> None:
    groups: dict[int, ProcessGroupGloo] = {}

    def join(rank: int) -> None:
        options = ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=10)
        options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        groups[rank] = ProcessGroupGloo(PrefixStore("receiver/sender/session", stores[rank]), rank, 2, options)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    sent, received = torch.arange(6.0), torch.zeros(6)
    send = groups[1].send([sent], 0, 3)
    groups[0].recv([received], 1, 3).wait()
    send.wait()
    assert torch.equal(received, sent)


def test_strangers_can_neither_read_nor_write(server: StoreServer, stores: list[AuthStore]) -> None:
    a, _ = stores
    a.set("pair/key", b"genuine")
    stranger = AuthStore(server.address, DeploymentSecret.new(), 0.5)  # another deployment's keys
    try:
        for call in (lambda: stranger.set("pair/key", b"poisoned"), lambda: stranger.get("pair/key"),
                     lambda: stranger.num_keys()):
            with pytest.raises(DistStoreError, match="did not answer"):
                call()
    finally:
        stranger.close()
    # torch's own TCPStore client, which could list and overwrite a TCPStore's keys.
    with pytest.raises((RuntimeError, DistStoreError)):
        TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=1)).set(
            "pair/key", b"poisoned")
    assert a.get("pair/key") == b"genuine" and a.num_keys() == 1
    assert server.refused >= 1


@pytest.mark.parametrize("receiver_secret,sender_secret", [(SECRET, None), (None, SECRET)])
def test_an_nccl_peer_with_a_secret_on_one_side_only_is_refused(receiver_secret, sender_secret) -> None:
    """Refused at the handshake (control.py's tag), before the store's own check of its
    kind (the data plane's, should a blob ever pass the handshake)."""
    receiver, sender = cpu_agent("nccl", "decode", receiver_secret), cpu_agent("nccl", "prefill", sender_secret)
    try:
        with pytest.raises(IncompatiblePeerError, match="deployment('s)? secret"):
            sender.add_peer(receiver.metadata())
        assert not sender.control.peers
    finally:
        sender.close()
        receiver.close()


def test_an_nccl_peer_announcing_a_bad_store_address_is_refused() -> None:
    receiver, sender = cpu_agent("nccl", "decode", None), cpu_agent("nccl", "prefill", None)
    try:
        meta = msgpack.unpackb(receiver.metadata(), raw=False)
        meta["data"]["store_port"] = "80"
        with pytest.raises(IncompatiblePeerError, match="announced its rendezvous store at '127.0.0.1':'80'"):
            sender.add_peer(msgpack.packb(meta, use_bin_type=True))
        assert not sender.control.peers
    finally:
        sender.close()
        receiver.close()


def test_an_nccl_agent_counts_the_strangers_its_store_refused() -> None:
    """A worker's stats (refused_peers) count its rendezvous store's refusals too."""
    receiver = cpu_agent("nccl", "decode", SECRET)
    try:
        before = receiver.refused_peers()
        meta = msgpack.unpackb(receiver.metadata(), raw=False)["data"]
        stranger = AuthStore(f"tcp://{meta['store_host']}:{meta['store_port']}", DeploymentSecret.new(), 0.5)
        try:
            with pytest.raises(DistStoreError):
                stranger.get("pair/key")
        finally:
            stranger.close()
        assert receiver.refused_peers() > before
    finally:
        receiver.close()
