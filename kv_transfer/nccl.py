"""nccl: torch.distributed point-to-point between a sender and a receiver (NCCL on
GPUs, gloo on CPU). Each (sender, receiver) pair gets its own 2-rank process group,
set up through a TCPStore the receiver hosts; no global world is needed, so pools can
grow and shrink. The notification goes first over the control channel, then one send
per run; the receiver posts the matching receives straight into the reserved blocks
(or into scratch memory, dropped, for a refused write).

With a deployment secret the store is an AuthStore (auth_store.py): only this
deployment's processes can read or write its keys, where a TCPStore would let anyone who
reaches its port hijack or poison the rendezvous. gloo's and NCCL's own connections,
which the rendezvous sets up, are not authenticated (docs/architecture.md).

Known limits: the receiver waits for a write's data inside poll(), up to `timeout_s`
when the sender stalls between its notification and its data; and a receive that times
out closes the pair's gloo connection, so that sender's later writes to this receiver
fail (their prompts are prefilled locally) until one of the two restarts. Receiving
asynchronously, into scratch memory copied in once complete, would lift both."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store, TCPStore

from kv_transfer.auth_store import AuthStore, StoreServer
from kv_transfer.base import KVTransport, TransportConfig
from kv_transfer.compat import IncompatiblePeerError
from kv_transfer.control import Peer
from kv_transfer.sender import Write
from protocol import encode
from protocol.kv_control import Join, Layers, Piece, Run

logger = logging.getLogger(__name__)

RECEIVER, SENDER = 0, 1  # ranks in every pairwise group


class NcclTransport(KVTransport):
    name = "nccl"
    one_sided = False
    fabric = "nccl"
    gathers_layers = True  # a layer range of a run: gathered into one send

    def __init__(self, agent_name: str, config: TransportConfig | None = None) -> None:
        super().__init__(agent_name, config)
        self._store: Store | None = None  # the one our senders meet us through
        self._store_server: StoreServer | None = None  # with a secret: what serves it
        self._peer_stores: dict[str, AuthStore] = {}  # with a secret: peer name -> its store
        self._groups: dict[str, Any] = {}  # peer name -> its pairwise process group
        self._joining: dict[str, threading.Thread] = {}
        self._join_errors: dict[str, str] = {}
        self._sessions: dict[str, str] = {}  # sender -> the session its group was made for

    def _timeout(self) -> timedelta:
        return timedelta(seconds=self.config.timeout_s)

    def _group(self, store: Any, rank: int) -> Any:
        if self.registered_cache.is_cuda:
            from torch.distributed import ProcessGroupNCCL

            return ProcessGroupNCCL(store, rank, 2, ProcessGroupNCCL.Options())
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the stubs have only Options (no _devices)
        options._timeout = self._timeout()
        options._devices = [ProcessGroupGloo.create_device(hostname=self.config.host)]
        return ProcessGroupGloo(store, rank, 2, options)

    def _register(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        # Senders of this agent's blocks meet it through this store.
        secret, host = self.config.secret, self.config.host
        if secret is None:
            self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=self._timeout())
            return {"store_host": host, "store_port": self._store.port, "store_auth": False}
        self._store_server = StoreServer(host, secret, self.agent_name)
        self._store = AuthStore(self._store_server.address, secret, self.config.timeout_s)
        return {"store_host": host, "store_port": self._store_server.port, "store_auth": True}

    def refused_peers(self) -> int:
        store = self._store_server.refused if self._store_server is not None else 0
        return super().refused_peers() + store

    def _peer_store(self, peer: Peer) -> Store:
        """A client of the store `peer` hosts; refused unless it is the kind ours is (a
        peer of another deployment, or one without a secret, cannot meet us)."""
        host, port, auth = (peer.data.get(k) for k in ("store_host", "store_port", "store_auth"))
        if not isinstance(host, str) or type(port) is not int or not 0 < port < 65536:
            raise IncompatiblePeerError(f"peer {peer.name!r} announced its rendezvous store at {host!r}:{port!r}")
        if auth is not (self.config.secret is not None):
            raise IncompatiblePeerError(f"peer {peer.name!r}'s rendezvous store is "
                                        f"{'' if auth else 'not '}authenticated, ours is "
                                        f"{'' if self.config.secret is not None else 'not '}(a deployment secret "
                                        "on one side only)")
        if self.config.secret is None:
            return TCPStore(host, port, is_master=False, timeout=self._timeout())
        store = AuthStore(f"tcp://{host}:{port}", self.config.secret, self.config.timeout_s)
        old = self._peer_stores.pop(peer.name, None)
        if old is not None:
            old.close()
        self._peer_stores[peer.name] = store
        return store

    def _connect(self, peer: Peer) -> None:
        store = self._peer_store(peer)
        session = uuid.uuid4().hex
        prefix = PrefixStore(f"{peer.name}/{self.agent_name}/{session}", store)
        peer.socket.send(encode(Join(session=session)))

        def join(store: Store) -> None:  # blocks until the receiver joins in its poll()
            # `store` is held for the call: C++ keeps no Python store alive, and
            # _disconnect may let go of it meanwhile.
            try:
                group = self._group(prefix, SENDER)
            except Exception as exc:
                group, error = None, str(exc)
            if self._joining.get(peer.name) is not threading.current_thread():
                return  # the peer was dropped (or replaced) meanwhile: not ours to set
            if group is not None:
                self._groups[peer.name] = group
            else:
                self._join_errors[peer.name] = error

        self._joining[peer.name] = thread = threading.Thread(target=join, args=(store,), daemon=True)
        thread.start()

    def _on_join(self, sender: str, session: str) -> None:
        if self._sessions.get(sender) == session:
            return
        self._disconnect(sender)  # a restarted sender: its old group is dead
        assert self._store is not None  # made by _register: a sender joins only after our handshake
        try:
            self._groups[sender] = self._group(
                PrefixStore(f"{self.agent_name}/{sender}/{session}", self._store), RECEIVER)
            self._sessions[sender] = session
        except RuntimeError as exc:  # the sender died while joining: its writes will expire
            logger.warning("transfer group with %r failed: %s", sender, exc)

    def _warm(self, peer: Peer) -> None:
        self._sender_group(peer.name)  # waits for the pairwise group (the receiver joins in its poll)

    def _disconnect(self, name: str) -> None:
        # Dropped, not shut down: shutting a group down may wait for the dead peer.
        self._groups.pop(name, None)
        self._sessions.pop(name, None)
        self._joining.pop(name, None)  # a join thread still waiting times out on its own
        self._join_errors.pop(name, None)
        store = self._peer_stores.pop(name, None)
        if store is not None:  # a join still running fails on it at once
            store.close()

    def _sender_group(self, peer: str) -> Any:
        thread = self._joining.get(peer)
        if thread is not None:
            thread.join(self.config.timeout_s)
            if thread.is_alive():
                raise RuntimeError(f"{peer!r} did not join the transfer group within "
                                   f"{self.config.timeout_s} s")
            del self._joining[peer]
        if peer not in self._groups:
            raise RuntimeError(f"no transfer group with {peer!r}: {self._join_errors.get(peer, 'never joined')}")
        return self._groups[peer]

    def _start(self, peer: Peer, write: Write) -> None:
        group = self._sender_group(peer.name)
        peer.socket.send(self._header(write))  # the receiver posts its receives on this
        # A layer range of a run is gathered first: a send takes one contiguous tensor.
        write.handle = [group.send([self._run_region(s, n, write.layers).contiguous()], RECEIVER, write.xfer)
                        for s, _, n in write.runs]

    def _run_region(self, start: int, count: int, layers: Layers | None) -> torch.Tensor:
        """Blocks [start, start + count) of the cache, every layer or `layers`."""
        l0, l1 = layers or (0, self.registered_compat.num_layers)
        return self._rank_layers[0][start:start + count, :, l0:l1]

    def _progress(self, write: Write) -> bool:
        for work in write.handle or []:
            if not work.is_completed():
                return False
            if not work.is_success():
                raise RuntimeError(f"send failed: {work.exception()}")
        return True

    def _send_notification(self, peer: Peer, write: Write) -> None:
        pass  # sent ahead of the data by _start

    def _receive(self, sender: str, xfer: int, runs: Sequence[Run], layers: Layers | None,
                 into_cache: bool) -> None:
        group = self._groups.get(sender)
        if group is None:
            raise RuntimeError(f"no transfer group with {sender!r}")
        for d, n in runs:
            # A recv fills one contiguous tensor: a layer range lands in a buffer first; a
            # refused write's data, in one of the size its sender sent (whatever its ids).
            cache = self._rank_layers[0]
            l0, l1 = layers or (0, cache.shape[2])
            region = self._run_region(d, n, layers) if into_cache else None
            target = region if region is not None and region.is_contiguous() else torch.empty(
                (n, cache.shape[1], max(0, l1 - l0), cache.shape[3]), dtype=cache.dtype, device=cache.device)
            group.recv([target], SENDER, xfer).wait(self._timeout())
            if region is not None and target is not region:
                region.copy_(target)

    def _apply(self, sender: str, xfer: int, runs: Sequence[Run], pieces: Sequence[Piece],
               frames: list[Any], layers: Layers | None) -> None:  # TP 1 only: one whole piece
        self._receive(sender, xfer, runs, layers, into_cache=True)

    def _discard(self, sender: str, xfer: int, runs: Sequence[Run], layers: Layers | None) -> None:
        self._receive(sender, xfer, runs, layers, into_cache=False)

    def _close(self) -> None:
        for group in self._groups.values():
            try:
                group.shutdown()
            except Exception:  # a peer may be gone already; nothing more to free
                pass
        self._groups.clear()
        for store in [*self._peer_stores.values(), self._store]:
            if isinstance(store, AuthStore):
                store.close()
        self._peer_stores.clear()
        if self._store_server is not None:
            self._store_server.close()
            self._store_server = None
