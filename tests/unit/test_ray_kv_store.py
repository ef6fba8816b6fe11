"""The Ray launcher's store actor (cluster/ray/kv_store.py) without Ray: it serves the
store on the deployment's CURVE plane at the port it is given, and a second one given
the first's port after it stopped (what Ray's restart of the actor does: the same
constructor arguments) serves a client that was connected to the first, which tells
the new store by its id."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import zmq

from cluster.ray.kv_store import StoreActor, free_port
from engine.kv_cache.shared_tier import SharedBlock
from kv_store import StoreClient
from security import DeploymentSecret

pytestmark = pytest.mark.timeout(60)

CAPACITY = 1 << 20


def block(block_hash: int) -> SharedBlock:
    return SharedBlock(block_hash, 0, (1, 2, 3), 7, bytes([block_hash % 256]) * 64)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 15.0,
             meanwhile: Callable[[], None] = lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        meanwhile()
        time.sleep(0.05)


def test_a_store_actor_restarted_at_its_port_serves_the_clients_of_the_first() -> None:
    secret = DeploymentSecret.new()
    port = free_port("127.0.0.1")  # as the launcher picks it, before the actor exists
    first = StoreActor(CAPACITY, port, "127.0.0.1", secret=secret)
    client = StoreClient(first.address(), secret, fetch_timeout_s=1.0, sync_interval_s=0.1)
    running = [first]
    try:
        assert first.address() == f"tcp://127.0.0.1:{port}"
        client.open(namespace=5)
        client.put(block(1))
        wait_for(lambda: client.holds(1), "the first store's block did not reach the client's directory")
        running.remove(first)
        first.stop()  # what a crash does to its socket; Ray then reruns the constructor
        second = StoreActor(CAPACITY, port, "127.0.0.1", secret=secret)
        running.append(second)
        assert second.address() == first.address()
        # Puts sent while the store was away may be lost: put again until one lands.
        wait_for(lambda: client.holds(2) and not client.holds(1),
                 "the client did not reconnect to the restarted store, or kept the old store's blocks",
                 meanwhile=lambda: client.put(block(2)))
        [got] = client.fetch([2])
        assert (got.block_hash, bytes(got.data)) == (2, block(2).data)
    finally:
        client.close()
        for actor in running:
            actor.stop()


def test_a_taken_port_fails_the_constructor_as_the_launcher_expects() -> None:
    """start_store picks another port when the error says the address is in use."""
    first = StoreActor(CAPACITY, 0, "127.0.0.1", secret=None)
    try:
        port = int(first.address().rpartition(":")[2])
        with pytest.raises(zmq.ZMQError, match="Address already in use"):
            StoreActor(CAPACITY, port, "127.0.0.1", secret=None)
    finally:
        first.stop()
