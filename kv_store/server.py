"""The shared KV store: KV blocks that every worker of a deployment writes to and reads
from, so that a prefix one worker computed is loaded by another instead of computed.

One ZMQ ROUTER, CURVE behind a PlaneGuard when the deployment has a secret (only its
workers get a message through), and a second one on a Unix socket for the workers on
the store's host (kv_store/local_endpoint.py: in the clear, reached only by this user),
serving protocol/kv_store.py's messages from one thread.
Blocks are kept in memory up to a capacity, least recently used evicted first (a fetch
or a put of a held block makes it most recently used). Every block added or evicted is
logged with a version number per namespace, so that a worker keeps a copy of the
directory (which blocks are here) and looks a prefix up without asking: StoreSync
answers the changes since the version the worker has, or everything held when the log
no longer reaches back that far.

The store is a cache: losing it, or any block in it, costs the workers only the time to
compute again; a worker waits on it at most its fetch timeout once, after which it
looks nothing up there until the store answers a sync again (kv_store/client.py).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from kv_store import local_endpoint
from protocol import MessageError, encode
from protocol.kv_store import (
    KV_STORE_MESSAGES,
    StoreBlocks,
    StoredBlock,
    StoreDirectory,
    StoreDrop,
    StoreFetch,
    StorePut,
    StoreSync,
)
from security import DeploymentSecret, PlaneGuard, serve_securely
from security.refusals import RefusalLog

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = 256 << 20  # one KV block of a large model is a few MiB
LOG_LENGTH = 1 << 16  # directory changes kept per namespace, for StoreSync
POLL_MS = 100  # how often the serving thread looks at its stop flag
Data = bytes | memoryview  # a block's bytes: the frame a put came in, or a copy
ZERO_COPY_BYTES = 1 << 16
MAX_ANSWER_BYTES = 64 << 20  # block bytes one fetch's answer carries at most (workers ask for 32 MiB)
BLOCK_OVERHEAD = 200  # bytes of a block's record besides its tokens, about (a msgspec Struct, its key)


@dataclass
class _Namespace:
    block_bytes: int  # every block of one configuration has the same size
    held: set[int] = field(default_factory=set)
    log: deque[tuple[int, int, bool]] = field(default_factory=lambda: deque(maxlen=LOG_LENGTH))  # (version, hash, added)


class KVStore:
    """The blocks, their LRU order and the directory log: no sockets (StoreServer serves it)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.id = int.from_bytes(os.urandom(8), "little")  # told with every directory: a restart shows
        self.used_bytes = 0  # blocks' bytes and records (_size)
        self.version = 0
        self._blocks: OrderedDict[tuple[int, int], tuple[StoredBlock, Data]] = OrderedDict()
        self._spaces: dict[int, _Namespace] = {}
        self.puts = self.fetches = self.hits = self.evicted = 0

    def put(self, namespace: int, block: StoredBlock, data: Data) -> str | None:
        """Keep the block (the least recently used go to make room); a reason if refused."""
        space = self._spaces.get(namespace)
        if space is not None and len(data) != space.block_bytes:
            return f"a block of {len(data)} bytes in a namespace of {space.block_bytes}-byte blocks"
        if len(data) == 0 or _size(block, data) > self.capacity_bytes:
            return f"a block of {len(data)} bytes (capacity {self.capacity_bytes})"
        self.puts += 1
        key = (namespace, block.block_hash)
        old = self._blocks.pop(key, None)
        if old is not None:  # the latest copy wins: one that failed a worker's check is replaced
            self.used_bytes -= _size(*old)
        while self.used_bytes + _size(block, data) > self.capacity_bytes and self._blocks:
            (old_space, old_hash), evicted = self._blocks.popitem(last=False)
            self.used_bytes -= _size(*evicted)
            self.evicted += 1
            self._changed(old_space, old_hash, added=False)
        if space is None:
            space = self._spaces[namespace] = _Namespace(len(data))
        self._blocks[key] = (block, data)
        self.used_bytes += _size(block, data)
        self._changed(namespace, block.block_hash, added=True)  # again if held: a worker may have forgotten it
        return None

    def drop(self, namespace: int, hashes: list[int]) -> None:
        for block_hash in hashes:
            old = self._blocks.pop((namespace, block_hash), None)
            if old is not None:
                self.used_bytes -= _size(*old)
                self._changed(namespace, block_hash, added=False)

    def fetch(self, namespace: int, hashes: list[int]) -> list[tuple[StoredBlock, Data]]:
        """The chain's first blocks held here, in order, up to MAX_ANSWER_BYTES (a
        chain never names a block twice: a repeat ends it, so one small message cannot
        ask for the same block thousands of times)."""
        self.fetches += 1
        out: list[tuple[StoredBlock, Data]] = []
        seen: set[int] = set()
        size = 0
        for block_hash in hashes:
            found = self._blocks.get((namespace, block_hash))
            if found is None or block_hash in seen or (out and size + len(found[1]) > MAX_ANSWER_BYTES):
                break
            seen.add(block_hash)
            size += len(found[1])
            self._blocks.move_to_end((namespace, block_hash))
            out.append(found)
        self.hits += len(out)
        return out

    def changes(self, namespace: int, since: int) -> tuple[bool, list[int], list[int]]:
        """(reset, added, removed) in `namespace` after version `since`."""
        space = self._spaces.get(namespace)
        if since > self.version:  # a version of an earlier store (this one restarted)
            return True, sorted(space.held) if space is not None else [], []
        if space is None or since == self.version:
            return False, [], []
        if since == 0 or not space.log or space.log[0][0] > since + 1:
            return True, sorted(space.held), []
        added: dict[int, bool] = {}
        for version, block_hash, was_added in space.log:
            if version > since:
                added[block_hash] = was_added  # the last change of a block is what holds
        return False, [h for h, a in added.items() if a], [h for h, a in added.items() if not a]

    def _changed(self, namespace: int, block_hash: int, added: bool) -> None:
        self.version += 1
        space = self._spaces[namespace]
        (space.held.add if added else space.held.discard)(block_hash)
        space.log.append((self.version, block_hash, added))


def _size(block: StoredBlock, data: Data) -> int:
    return stored_size(len(data), len(block.token_ids))


def stored_size(num_bytes: int, num_tokens: int) -> int:
    """What a block costs the store: its bytes and its record (the directory log and the
    namespaces, bounded by LOG_LENGTH and the deployment's configurations, are not counted)."""
    return num_bytes + 8 * num_tokens + BLOCK_OVERHEAD


class StoreServer:
    """A KVStore served on `host` (port 0: any free one) by a thread of its own."""

    def __init__(self, capacity_bytes: int, host: str, port: int = 0, secret: DeploymentSecret | None = None,
                 name: str = "kv-store", local: bool = True) -> None:
        """local: also listen on the same-host Unix socket (local_endpoint.py)."""
        self.store = KVStore(capacity_bytes)
        self._ctx = zmq.Context()
        self._guard = PlaneGuard(self._ctx, secret, name) if secret is not None else None  # before the bind
        self._sock = self._router()
        try:
            if secret is not None:
                serve_securely(self._sock, secret)
            if port == 0:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError:
            # Closed here, not when collected: a context collected before its sockets
            # waits for them forever (a store retrying a port in use hung, bind_store).
            if self._guard is not None:
                self._guard.close()
            self._ctx.destroy(linger=0)
            raise
        self.address = f"tcp://{host}:{port}"
        if self._guard is not None:
            self._guard.watch(self._sock)
            self._guard.start()
        self._local = self._local_socket(self.address, secret) if local else None
        # The same-host socket's endpoint (ipc://...), or None if there is none.
        self.local_address = self._local.get_string(zmq.LAST_ENDPOINT) if self._local is not None else None
        self._refusals = RefusalLog(logger)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _local_socket(self, address: str, secret: DeploymentSecret | None) -> zmq.Socket | None:
        """The ROUTER on the same-host Unix socket, or None (logged) if it cannot be bound."""
        endpoint = local_endpoint.bind_path(address, secret)
        if endpoint is None:
            return None
        sock = self._router()
        try:
            sock.bind(endpoint)
            local_endpoint.make_private(endpoint)
        except (zmq.ZMQError, OSError) as exc:
            logger.warning("KV store: no same-host socket at %s (%s); workers reach it over TCP", endpoint, exc)
            sock.close(0)
            return None
        return sock

    def _router(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        return sock

    @property
    def refused(self) -> int:
        """Peers refused by the guard, and messages refused by the store."""
        return (self._guard.refused if self._guard is not None else 0) + self._refusals.count

    def start(self) -> StoreServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self.local_address is not None:  # libzmq leaves the socket's file behind
            # Before the TCP port is let go: a store restarted at this address, which binds
            # this path again, cannot have got past its TCP bind yet.
            Path(self.local_address.removeprefix("ipc://")).unlink(missing_ok=True)
            self.local_address = None
        if self._guard is not None:
            self._guard.close()
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self._sock, self._local):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(POLL_MS):
                self._serve_one(sock)

    def _serve_one(self, sock: zmq.Socket) -> None:
        """One message from `sock`, answered there."""
        frames = sock.recv_multipart(copy=False)
        try:
            self._handle(sock, frames[0].bytes, [f.buffer for f in frames[1:]])
        except MessageError as exc:
            self._refusals.refused("kv store: refused a message: %s", str(exc))
        except Exception as exc:  # whatever a peer sent, the store serves on
            logger.exception("kv store: a message failed")
            self._refusals.refused("kv store: a message failed: %s: %s", type(exc).__name__, exc)

    def _handle(self, sock: zmq.Socket, peer: bytes, frames: list[memoryview]) -> None:
        if not frames:
            raise MessageError("an empty message")
        msg = KV_STORE_MESSAGES.decode(bytes(frames[0]))
        data = frames[1:]
        if isinstance(msg, StorePut):
            if len(data) != 1:
                raise MessageError(f"store_put with {len(data)} data frames, not 1", msg.kind)
            # A large block's frame is kept as it is (its memoryview holds it) rather than
            # copied; a small one may share a receive buffer larger than itself: copied.
            block = data[0] if len(data[0]) >= ZERO_COPY_BYTES else bytes(data[0])
            reason = self.store.put(msg.namespace, msg.block, block)
            if reason is not None:
                raise MessageError(f"store_put refused: {reason}", msg.kind)
        elif isinstance(msg, StoreDrop):
            self.store.drop(msg.namespace, msg.hashes)
        elif isinstance(msg, StoreFetch):
            found = self.store.fetch(msg.namespace, msg.hashes)
            sock.send_multipart([peer, encode(StoreBlocks(seq=msg.seq, blocks=[b for b, _ in found])),
                                 *(data for _, data in found)], copy=False)
        elif isinstance(msg, StoreSync):
            reset, added, removed = self.store.changes(msg.namespace, msg.since)
            sock.send_multipart([peer, encode(StoreDirectory(seq=msg.seq, store=self.store.id,
                                                             version=self.store.version,
                                                             reset=reset, added=added, removed=removed,
                                                             capacity_bytes=self.store.capacity_bytes,
                                                             used_bytes=self.store.used_bytes))])
        else:
            raise MessageError(f"{msg.kind} is not a request to the store", msg.kind)
