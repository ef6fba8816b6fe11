"""A worker's side of the shared KV store (kv_store/server.py): the engine's SharedTier
(engine/kv_cache/shared_tier.py).

The store is reached over its same-host Unix socket when it runs on this worker's host
(kv_store/local_endpoint.py), else over TCP with CURVE. Two sockets, each used by one
thread only: the tiers' I/O thread puts and fetches blocks on one (fetch waits for its
answer up to fetch_timeout_s); a thread of the client's own keeps the copy of the
store's directory on the other, asking for the changes every sync_interval_s. Once a
fetch times out, nothing is fetched or found there until the store answers a sync
again; while it does not, the copy is empty: the workers compute instead, and wait on
the store at most one fetch timeout.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

import zmq

from engine.kv_cache.shared_tier import SharedBlock, StoreUnavailable
from kv_store.local_endpoint import connect_path
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
from security import DeploymentSecret, connect_securely

logger = logging.getLogger(__name__)

SEND_QUEUE = 64  # puts queued toward the store at most; beyond, a put is dropped
MAX_CHANGES = 1 << 16  # directory changes kept untaken at most; beyond, they are dropped (take says so)
MAX_REVOKED = 1 << 16  # revoked hashes remembered at most, oldest forgotten first
PROBE_S, MAX_PROBE_S = 5.0, 80.0  # back over the same-host socket: tried after 5 s over TCP, then 10, 20 ... 80


class StoreClient:
    def __init__(self, address: str, secret: DeploymentSecret | None, fetch_timeout_s: float = 1.0,
                 sync_interval_s: float = 0.2, name: str = "kv-store-client", same_host: bool = True) -> None:
        """same_host False: always over TCP, never the store's same-host socket."""
        self.address, self.fetch_timeout_s, self.sync_interval_s = address, fetch_timeout_s, sync_interval_s
        self._same_host = same_host
        self.endpoint = address  # where the I/O socket connected (the same-host socket's ipc:// path, or address)
        # The store did not answer the sync thread over its same-host socket: TCP until it
        # does not answer there either (a socket file with no store behind it, or a store
        # back at its address without one). Read by both threads (a bool: atomic).
        self._avoid_local = False
        # Bumped by the sync thread at each reconnection, and by a fetch that timed out: the
        # I/O socket is made again, where _connect chooses then, at its next use.
        self._generation = self._io_generation = 0
        self._secret, self._name = secret, name
        self._ctx = zmq.Context()
        self._namespace: int | None = None
        self._held: set[int] = set()
        self._version = 0
        self._store: int | None = None  # the id of the store the copy is of
        self._usage = (0, 0)  # the store's (capacity, used) bytes, as its latest directory said
        # A fetch timed out: fetch nothing and find nothing until the store answers a sync
        # (so loads queued on the I/O thread do not each wait the timeout out).
        self._down = False
        self._lock = threading.Lock()  # _held, _version, _changes: the sync thread writes, the engine's reads
        self._changes: list[tuple[int, bool]] | None = None  # kept once track_changes is called
        self._changes_lost = False
        self._seq = itertools.count(1)
        self._io_sock: zmq.Socket | None = None  # made by the I/O thread, its only user
        # Blocks whose bytes were bad when put (revoke): never found or put again by this
        # client, whatever a directory says; their StoreDrop waits in _drops until sent.
        self._revoked: OrderedDict[int, None] = OrderedDict()
        self._drops: deque[list[int]] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sync_loop, name=f"{name}-sync", daemon=True)
        self.puts = self.dropped_puts = self.fetches = self.failed_fetches = 0

    def open(self, namespace: int) -> None:
        self._namespace = namespace
        self._thread.start()

    def holds(self, block_hash: int) -> bool:
        # Lookups of a set and a dict are atomic under the GIL.
        return not self._down and block_hash in self._held and block_hash not in self._revoked

    def blocks(self) -> int:
        return len(self._held)

    def usage(self) -> tuple[int, int]:
        return self._usage

    def forget(self, hashes: Sequence[int]) -> None:
        with self._lock:
            self._update(set(self._held) - set(hashes))

    def track_changes(self) -> None:
        with self._lock:
            if self._changes is None:
                self._changes = [(h, True) for h in self._held]

    def take_changes(self) -> tuple[list[tuple[int, bool]], bool]:
        with self._lock:
            changes, lost = self._changes or [], self._changes_lost
            if self._changes is not None:
                self._changes, self._changes_lost = [], False
            return changes, lost

    def _update(self, held: set[int]) -> None:
        """The directory is `held` now (the lock held): record what changed."""
        if self._changes is not None:
            self._changes += [(h, False) for h in self._held - held] + [(h, True) for h in held - self._held]
            if len(self._changes) > MAX_CHANGES:
                self._changes, self._changes_lost = [], True
        self._held = held

    def put(self, block: SharedBlock) -> None:
        assert self._namespace is not None
        self.send_drops()
        if block.block_hash in self._revoked:  # a seal that ran as it was revoked: its bytes are bad
            return
        msg = StorePut(namespace=self._namespace, block=StoredBlock(
            block_hash=block.block_hash, parent_hash=block.parent_hash, token_ids=list(block.token_ids),
            checksum=block.checksum))
        try:
            self._socket().send_multipart([encode(msg), block.data], flags=zmq.NOBLOCK, copy=False)
            self.puts += 1
        except zmq.Again:  # the store is slow or gone: a tier is a cache
            self.dropped_puts += 1

    def revoke(self, hashes: Sequence[int]) -> None:
        with self._lock:
            for h in hashes:
                self._revoked[h] = None
                self._revoked.move_to_end(h)
            while len(self._revoked) > MAX_REVOKED:
                self._revoked.popitem(last=False)
            self._update(set(self._held) - set(hashes))
        self._drops.append(list(hashes))

    def send_drops(self) -> None:
        """Send each StoreDrop revoke() queued, on the I/O socket: after any put of its
        blocks, so the store applies it after them. One the queue toward the store has no
        room for waits for the next call (a put, a fetch, or the tiers' drop job)."""
        while self._drops:
            hashes = self._drops[0]
            try:
                self._socket().send(encode(StoreDrop(namespace=self._namespace or 0, hashes=hashes)), flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self._drops.popleft()

    def fetch(self, hashes: Sequence[int]) -> list[SharedBlock]:
        assert self._namespace is not None
        self.send_drops()
        revoked = next((i for i, h in enumerate(hashes) if h in self._revoked), None)
        hashes = hashes[:revoked]  # a load queued before the revoke: the chain ends there
        if not hashes:
            return []
        self.fetches += 1
        sock, seq = self._socket(), next(self._seq)
        frames = None
        if not self._down:
            try:
                sock.send(encode(StoreFetch(seq=seq, namespace=self._namespace, hashes=list(hashes))),
                          flags=zmq.NOBLOCK)
                frames = _answer(sock, seq, StoreBlocks, self.fetch_timeout_s)
            except zmq.Again:  # puts fill the queue toward a store that does not read
                pass
        if frames is None:
            self.failed_fetches += 1
            self._down = True
            self._io_generation = -1  # made again at its next use
            raise StoreUnavailable(f"the KV store at {self.address} did not answer a fetch "
                                   f"in {self.fetch_timeout_s:g} s")
        msg, data = frames
        if len(data) != len(msg.blocks) or len(msg.blocks) > len(hashes) or any(
                b.block_hash != h for b, h in zip(msg.blocks, hashes)):
            raise MessageError("store_blocks does not answer the fetch (blocks, hashes or frames differ)")
        return [SharedBlock(b.block_hash, b.parent_hash, tuple(b.token_ids), b.checksum, d)
                for b, d in zip(msg.blocks, data)]

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)  # the I/O thread's socket too: the tiers close after it stops

    def _connect(self) -> tuple[zmq.Socket, str]:
        """A socket to the store, and where it connected: over its same-host Unix socket
        when this worker is on its host (kv_store/local_endpoint.py: no encryption to pay
        for) and it answered there, else over TCP with the deployment's CURVE keys."""
        sock = self._dealer()
        local = connect_path(self.address, self._secret) if self._same_host and not self._avoid_local else None
        if local is None and self._secret is not None:
            connect_securely(sock, self._secret)
        sock.connect(local or self.address)
        return sock, local or self.address

    def _dealer(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        return sock

    def _socket(self) -> zmq.Socket:
        """The I/O thread's socket, made again after the sync thread reconnected or a fetch
        timed out (so that it never stays on a path where the store no longer answers)."""
        if self._io_sock is None or self._io_generation != self._generation:
            if self._io_sock is not None:
                self._io_sock.close(0)
            self._io_generation = self._generation
            self._io_sock, self.endpoint = self._connect()
        return self._io_sock

    def _probe_local(self) -> tuple[zmq.Socket, str] | None:
        """A socket over the store's same-host socket if the store answers a sync there
        now (the one it answers over TCP: the same id), else None."""
        local = connect_path(self.address, self._secret) if self._same_host else None
        if local is None:
            return None
        sock = self._dealer()
        sock.connect(local)
        frames = self._ask_directory(sock)
        if frames is None or frames[0].store != self._store:
            sock.close(0)
            return None
        return sock, local

    def _ask_directory(self, sock: zmq.Socket) -> tuple | None:
        """The store's directory changes since this copy's version, asked on `sock`
        (None: no answer within a sync's timeout)."""
        assert self._namespace is not None
        seq = next(self._seq)
        try:
            sock.send(encode(StoreSync(seq=seq, namespace=self._namespace, since=self._version)), zmq.NOBLOCK)
        except zmq.Again:
            pass
        return _answer(sock, seq, StoreDirectory, max(1.0, 4 * self.sync_interval_s))

    def _sync_loop(self) -> None:
        sock, endpoint = self._connect()
        # Over TCP since the store did not answer over its same-host socket (a stall of a
        # second is enough): try that socket again now and then, at doubling intervals
        # while it still does not answer, so a worker does not pay for CURVE for good.
        probe_interval, next_probe = PROBE_S, time.monotonic() + PROBE_S
        while not self._stop.wait(self.sync_interval_s):
            if self._avoid_local and not endpoint.startswith("ipc://") and not self._down \
                    and time.monotonic() >= next_probe:
                probed = self._probe_local()
                if probed is not None:
                    sock.close(0)
                    (sock, endpoint), self._avoid_local, probe_interval = probed, False, PROBE_S
                    self._generation += 1  # the I/O socket follows
                else:
                    probe_interval = min(2 * probe_interval, MAX_PROBE_S)
                next_probe = time.monotonic() + probe_interval
            frames = self._ask_directory(sock)
            if frames is None:
                self._down = True
                if self._version or self._held:
                    logger.warning("%s: the KV store at %s does not answer: its blocks are not looked up "
                                   "until it does", self._name, self.address)
                with self._lock:  # nothing waits on a store that is gone; a fresh copy once it is back
                    self._update(set())
                    self._version = 0
                sock.close(0)
                # A fresh connection drops what was queued toward it; after one over the
                # same-host socket, over TCP (and the other way round), the I/O socket too.
                self._avoid_local = endpoint.startswith("ipc://")
                sock, endpoint = self._connect()
                self._generation += 1
                probe_interval, next_probe = PROBE_S, time.monotonic() + PROBE_S
                continue
            directory = frames[0]
            self._down = False
            self._usage = (directory.capacity_bytes, directory.used_bytes)
            if self._store is not None and directory.store != self._store:  # restarted: start over
                with self._lock:
                    self._update(set())
                    self._version, self._store = 0, directory.store
                continue
            self._store = directory.store
            if not (directory.reset or directory.added or directory.removed):
                self._version = directory.version
                continue
            with self._lock:
                held = set() if directory.reset else set(self._held)
                held.update(directory.added)
                held.difference_update(directory.removed)
                self._update(held)
                self._version = directory.version
        sock.close(0)


def _answer(sock: zmq.Socket, seq: int, kind: type, timeout_s: float) -> tuple | None:
    """The answer `seq` of type `kind` and its data frames, or None after timeout_s
    (answers to calls given up on, and anything else, are dropped on the way)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000) + 1):
            return None
        frames = sock.recv_multipart(copy=False)
        try:
            msg = KV_STORE_MESSAGES.decode(frames[0].bytes)
        except MessageError as exc:
            logger.warning("the KV store sent a message we refuse: %s", exc)
            continue
        if isinstance(msg, kind) and getattr(msg, "seq", None) == seq:
            return msg, [f.buffer for f in frames[1:]]
    return None

