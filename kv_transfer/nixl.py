"""nixl: NIXL agent with the UCX backend, one-sided WRITE (DRAM on CPU, VRAM on GPU).

One agent per worker, in its driver: it registers every rank's cache (a TP worker on
CPU maps them all). Both sides are described to NIXL once per peer, as prepared
descriptor lists built locally from base addresses (never from NIXL's pickled
descriptor lists): for each piece of the rank-pair plan (rank_pairs.py), one
descriptor per block, the piece's heads of that block (every head of a whole piece:
the whole block; any other piece: its head slice, at its offset within the block).
The lists of a plan's pieces are one list, piece after piece, so that a write is one
NIXL transfer over index arrays (block id + piece * blocks), whatever the TP sizes;
NIXL merges descriptors consecutive on both sides into runs. Describing the runs
afresh for every write cost more than moving them (docs/benchmarks/2026-11-30-gpu-check-h200.md).

Its NIXL notification is our "written" message, which NIXL delivers after all the
transfer's data: one transfer per write is what lets the receiver never hear of a
write before every piece landed. It travels over UCX, outside the control plane's
CURVE sockets: with a deployment secret it carries a tag (sign_notification) and the
receiver drops, logs and counts (stats["notifications_refused"]) any whose tag does not
prove the secret, before acting on it. NIXL has no timeouts of its own: the sender's state
(sender.py) bounds every write. Between TP sizes on GPUs each rank's cache lives on
its own GPU, which this one agent cannot reach: refused (CPU caches only).
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import numpy as np
import torch

from kv_transfer.base import KVTransport, TransportConfig
from kv_transfer.compat import IncompatiblePeerError
from kv_transfer.control import Peer
from kv_transfer.fabric import ucx_fabric
from kv_transfer.rank_pairs import Piece
from kv_transfer.runs import block_pairs
from kv_transfer.sender import Write
from security import DeploymentSecret
from security.refusals import RefusalLog
from security.secret import TAG_BYTES

logger = logging.getLogger(__name__)


# A plan as its local list needs it: (src_rank, src_head, num_heads) per piece.
LocalKey = tuple[tuple[int, int, int], ...]


def _import_nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise RuntimeError(f"the nixl transport needs the nixl package: {exc}") from None
    return nixl_agent, nixl_agent_config


class NixlTransport(KVTransport):
    name = "nixl"
    one_sided = True
    stream_ordered = False  # UCX reads VRAM when it posts, whatever the compute stream has queued
    multi_rank = True  # CPU caches only (_register)

    def __init__(self, agent_name: str, config: TransportConfig | None = None) -> None:
        super().__init__(agent_name, config)
        nixl_agent, nixl_agent_config = _import_nixl()
        self.fabric, why = ucx_fabric()
        if self.fabric == "tcp":  # UCX says nothing of it: KV crosses hosts at a fraction of RDMA's rate
            logger.warning("%s: nixl moves KV between hosts over TCP, not RDMA: %s", agent_name, why)
        else:
            logger.info("%s: nixl may move KV between hosts over RDMA: %s", agent_name, why)
        self._agent = nixl_agent(agent_name, nixl_agent_config(
            enable_prog_thread=self.config.progress_thread, backends=["UCX"]))
        self._registered = None
        # Prepared lists of our caches, one per plan (peers with the same plan share it).
        self._local: dict[LocalKey, Any] = {}
        self._remote: dict[str, tuple[Any, Any]] = {}  # peer name -> (its prepared list, ours for its plan)
        # A layer range's lists, prepared at connect with stream: layer (else on a peer's
        # first layer write): a descriptor per (piece, block, head, layer) on each side,
        # peer name -> (its, ours).
        self._layer_lists: dict[str, tuple[Any, Any]] = {}
        self._local_layers: dict[LocalKey, Any] = {}  # ours, per plan, as _local
        self.stats["notifications_refused"] = 0
        self._refusals = RefusalLog(logger)

    def _mem_type(self) -> str:
        return "VRAM" if self.registered_cache.is_cuda else "DRAM"

    def _device_id(self) -> int:
        return (self.registered_cache.device.index or 0) if self.registered_cache.is_cuda else 0

    def _register(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        if len(self.kv_caches) > 1 and kv_cache.is_cuda:
            raise ValueError(f"the nixl transport cannot register {len(self.kv_caches)} rank caches on "
                             f"{kv_cache.device}: KV transfers between TP>1 workers over nixl are built for CPU "
                             "caches only (on GPUs they need a transfer agent per rank, on its GPU); use TP 1 there")
        self._registered = self._agent.register_memory(self.kv_caches)
        return {"agent": self._agent.get_agent_metadata(), "bases": [c.data_ptr() for c in self.kv_caches],
                "device_id": self._device_id(), "mem": self._mem_type()}

    def _connect(self, peer: Peer) -> None:
        data = peer.data
        bases = data.get("bases")
        if (not isinstance(bases, list) or len(bases) != peer.compat.tp_size
                or not all(type(b) is int and b > 0 for b in bases)):
            raise IncompatiblePeerError(f"peer {peer.name!r} announced cache bases {bases!r} for its "
                                        f"{peer.compat.tp_size} ranks")
        whole_blocks = len(peer.pieces) == 1 and peer.pieces[0].whole
        if not whole_blocks and "VRAM" in (self._mem_type(), data["mem"]):
            raise IncompatiblePeerError(f"peer {peer.name!r} at TP {peer.compat.tp_size}: moving KV between TP "
                                        f"sizes (this worker is at TP {self.registered_compat.tp_size}) over nixl is "
                                        "built for CPU caches only")
        local = self._local_list(peer.pieces)
        hb = self.registered_compat.head_bytes
        remote_rows = _piece_descs(peer.pieces, "dst", bases, [n * hb for n in peer.compat.local_heads],
                                   data["num_blocks"], data["device_id"], hb)
        name = self._agent.add_remote_agent(data["agent"])
        name = name.decode() if isinstance(name, bytes) else name  # NIXL returns bytes
        try:
            if name != peer.name:
                raise ValueError(f"NIXL agent {name!r} announced itself as {peer.name!r}")
            try:  # NIXL checks each descriptor against the memory the peer's agent registered
                remote = self._agent.prep_xfer_dlist(peer.name, remote_rows, data["mem"])
            except Exception as exc:
                raise IncompatiblePeerError(f"peer {peer.name!r}'s caches are not where it announced them "
                                            f"(NIXL: {exc})") from None
        except BaseException:
            self._agent.remove_remote_agent(name)
            raise
        self._remote[peer.name] = (remote, local)
        if self.config.stream == "layer":  # now, not inside the first prompt's forward
            try:
                self._layer_lists_for(peer)
            except BaseException:
                self._disconnect(peer.name)
                raise

    def _local_list(self, pieces: list[Piece]) -> Any:
        key = tuple((p.src_rank, p.src_head, p.num_heads) for p in pieces)
        if key not in self._local:
            rows = _piece_descs(pieces, "src", [c.data_ptr() for c in self.kv_caches],
                                [b.shape[1] for b in self._rank_bytes], self.registered_cache.shape[0],
                                self._device_id(), self.registered_compat.head_bytes)
            self._local[key] = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self._mem_type())
        return self._local[key]

    def _layer_lists_for(self, peer: Peer) -> tuple[Any, Any]:
        """(the peer's, ours) lists of a descriptor per (piece, block, head, layer): a
        layer range of a block's head is a run of them, which NIXL merges into one."""
        if peer.name not in self._layer_lists:
            data, compat = peer.data, self.registered_compat
            key = tuple((p.src_rank, p.src_head, p.num_heads) for p in peer.pieces)
            if key not in self._local_layers:
                rows = _layer_descs(peer.pieces, "src", [c.data_ptr() for c in self.kv_caches],
                                    [b.shape[1] for b in self._rank_bytes], self.registered_cache.shape[0],
                                    self._device_id(), compat.head_bytes, compat.num_layers)
                self._local_layers[key] = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, self._mem_type())
            rows = _layer_descs(peer.pieces, "dst", data["bases"], [n * compat.head_bytes for n in peer.compat.local_heads],
                                data["num_blocks"], data["device_id"], compat.head_bytes, compat.num_layers)
            remote = self._agent.prep_xfer_dlist(peer.name, rows, data["mem"])
            self._layer_lists[peer.name] = (remote, self._local_layers[key])
        return self._layer_lists[peer.name]

    def _warm(self, peer: Peer) -> None:
        self._agent.make_connection(peer.name)  # UCX endpoints, else made by the first write

    def _disconnect(self, name: str) -> None:
        layer_lists = self._layer_lists.pop(name, None)
        if layer_lists is not None:
            self._agent.release_dlist_handle(layer_lists[0])
        lists = self._remote.pop(name, None)
        if lists is not None:
            self._agent.release_dlist_handle(lists[0])
            self._agent.remove_remote_agent(name)

    def _start(self, peer: Peer, write: Write) -> None:
        if write.layers is not None:
            remote, local = self._layer_lists_for(peer)
            src, dst = _layer_indices(write, self.registered_cache.shape[0], peer.data["num_blocks"],
                                      self.registered_compat.num_layers)
        else:
            remote, local = self._remote[peer.name]
            src, dst = block_pairs(write.runs)
            if len(write.pieces) > 1:  # piece i's descriptors follow i * blocks earlier ones, on each side
                src = np.concatenate([src + i * self.registered_cache.shape[0] for i in range(len(write.pieces))])
                dst = np.concatenate([dst + i * peer.data["num_blocks"] for i in range(len(write.pieces))])
        notification = self._header(write)
        if self.config.secret is not None:
            notification = sign_notification(self.config.secret, self.agent_name, peer.name, notification)
        handle = self._agent.make_prepped_xfer("WRITE", local, src, remote, dst, notification)
        write.handle = handle
        if self._agent.transfer(handle) == "ERR":
            raise RuntimeError("NIXL refused to post the transfer")

    def _progress(self, write: Write) -> bool:
        state = self._agent.check_xfer_state(write.handle)
        if state == "ERR":
            raise RuntimeError("NIXL transfer failed")
        if state != "DONE":
            return False
        self._agent.release_xfer_handle(write.handle)
        write.handle = None
        return True

    def _send_notification(self, peer: Peer, write: Write) -> None:
        pass  # NIXL delivered _header(write) after the data

    def _incoming_notifications(self) -> list[tuple[bytes, bytes]]:
        found = []
        for sender, msgs in self._agent.get_new_notifs().items():
            name = sender.decode(errors="replace") if isinstance(sender, bytes) else sender
            for msg in msgs:
                if self.config.secret is not None:
                    msg = open_notification(self.config.secret, name, self.agent_name, msg)
                    if msg is None:
                        self._refused(name)
                        continue
                found.append((name.encode(), msg))
        return found

    def _refused(self, sender: str) -> None:
        self._refusals.refused("%s dropped a NIXL notification from %r whose tag does not prove the deployment's "
                               "secret", self.agent_name, sender)
        self.stats["notifications_refused"] = self._refusals.count

    def _abandon(self, write: Write) -> None:
        if write.handle is not None:
            self._agent.release_xfer_handle(write.handle)
            write.handle = None

    def _close(self) -> None:
        for name in list(self._remote):
            self._disconnect(name)
        for dlist in [*self._local.values(), *self._local_layers.values()]:
            self._agent.release_dlist_handle(dlist)
        self._local.clear()
        self._local_layers.clear()
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
            self._registered = None


def _tagged(sender: str, receiver: str, header: bytes) -> bytes:
    # The names are in what the tag covers: a notification is good only from that sender to that receiver.
    return msgpack.packb(["pdserve nixl written", sender, receiver, header], use_bin_type=True)


def sign_notification(secret: DeploymentSecret, sender: str, receiver: str, header: bytes) -> bytes:
    """The notification `sender` sends `receiver`: `header`, then its tag."""
    return header + secret.tag(_tagged(sender, receiver, header))


def open_notification(secret: DeploymentSecret, sender: str, receiver: str, notification: bytes) -> bytes | None:
    """The header of a notification from `sender`, or None unless its tag proves the secret."""
    if not isinstance(notification, bytes) or len(notification) < TAG_BYTES:
        return None
    header, tag = notification[:-TAG_BYTES], notification[-TAG_BYTES:]
    return header if secret.verify(_tagged(sender, receiver, header), tag) else None


def _piece_descs(pieces: list[Piece], side: str, bases: list[int], block_bytes: list[int], num_blocks: int,
                 device_id: int, head_bytes: int) -> np.ndarray:
    """[len(pieces) * num_blocks, 3] (address, length, device id) rows: for each piece in
    turn, one per block of the ranks' caches on `side` ("src" or "dst"), the piece's
    heads of that block (at TP 1 on both sides: the whole block)."""
    rows = np.empty((len(pieces) * num_blocks, 3), dtype=np.int64)
    blocks = np.arange(num_blocks, dtype=np.int64)
    for i, p in enumerate(pieces):
        rank, head = (p.src_rank, p.src_head) if side == "src" else (p.dst_rank, p.dst_head)
        part = rows[i * num_blocks:(i + 1) * num_blocks]
        part[:, 0] = bases[rank] + blocks * block_bytes[rank] + head * head_bytes
        part[:, 1] = p.num_heads * head_bytes
        part[:, 2] = device_id
    return rows


def _layer_descs(pieces: list[Piece], side: str, bases: list[int], block_bytes: list[int], num_blocks: int,
                 device_id: int, head_bytes: int, num_layers: int) -> np.ndarray:
    """(address, length, device id) rows: for each piece in turn, for each block of the
    ranks' caches on `side`, for each of the piece's heads, one per layer of that head."""
    layer_bytes = head_bytes // num_layers
    parts = []
    blocks = np.arange(num_blocks, dtype=np.int64)[:, None, None]
    layers = np.arange(num_layers, dtype=np.int64)[None, None, :]
    for p in pieces:
        rank, head = (p.src_rank, p.src_head) if side == "src" else (p.dst_rank, p.dst_head)
        heads = np.arange(head, head + p.num_heads, dtype=np.int64)[None, :, None]
        addresses = bases[rank] + blocks * block_bytes[rank] + heads * head_bytes + layers * layer_bytes
        part = np.empty((addresses.size, 3), dtype=np.int64)
        part[:, 0], part[:, 1], part[:, 2] = addresses.ravel(), layer_bytes, device_id
        parts.append(part)
    return np.concatenate(parts)


def _layer_indices(write: Write, src_blocks: int, dst_blocks: int, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """A layer write's descriptor indices into the lists of _layer_descs, each side's:
    per piece, block, head, then layer, so that each head's layers are consecutive."""
    assert write.layers is not None
    src, dst = block_pairs(write.runs)
    layers = np.arange(*write.layers, dtype=np.int64)[None, None, :]
    src_parts: list[np.ndarray] = []
    dst_parts: list[np.ndarray] = []
    src_off = dst_off = 0
    for p in write.pieces:
        heads = np.arange(p.num_heads, dtype=np.int64)[None, :, None]
        for blocks, off, parts in ((src, src_off, src_parts), (dst, dst_off, dst_parts)):
            b = blocks.astype(np.int64)[:, None, None]
            parts.append((off + (b * p.num_heads + heads) * num_layers + layers).ravel())
        src_off += src_blocks * p.num_heads * num_layers
        dst_off += dst_blocks * p.num_heads * num_layers
    return np.concatenate(src_parts), np.concatenate(dst_parts)
