"""nixl: NIXL agent with the UCX backend, one-sided WRITE (DRAM on CPU, VRAM on GPU).

Both caches are described to NIXL once, block by block, as prepared descriptor lists
(built locally from the peer's base address and block size, never from NIXL's pickled
descriptor lists). A write is then one NIXL transfer made from two arrays of block
indices, which NIXL merges into runs; describing the runs afresh for every write cost
more than moving them (docs/benchmarks.md, GPU check). Its NIXL notification is our
"written" message, delivered after the data. NIXL has no timeouts of its own: the
sender's state (sender.py) bounds every write.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kv_transfer.base import KVTransport, TransportConfig
from kv_transfer.control import Peer
from kv_transfer.runs import block_pairs
from kv_transfer.sender import Write


def _import_nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise RuntimeError(f"the nixl transport needs the nixl package: {exc}") from None
    return nixl_agent, nixl_agent_config


class NixlTransport(KVTransport):
    name = "nixl"
    one_sided = True

    def __init__(self, agent_name: str, config: TransportConfig | None = None) -> None:
        super().__init__(agent_name, config)
        nixl_agent, nixl_agent_config = _import_nixl()
        self._agent = nixl_agent(agent_name, nixl_agent_config(
            enable_prog_thread=self.config.progress_thread, backends=["UCX"]))
        self._registered = None
        self._local_blocks = None  # prepared descriptor list, one entry per local block
        self._remote_blocks: dict[str, Any] = {}  # peer name -> the same for its cache

    def _mem_type(self) -> str:
        return "VRAM" if self.kv_cache.is_cuda else "DRAM"

    def _device_id(self) -> int:
        return (self.kv_cache.device.index or 0) if self.kv_cache.is_cuda else 0

    def _register(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        self._registered = self._agent.register_memory(kv_cache)
        self._local_blocks = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _block_descs(kv_cache.data_ptr(), self.compat.block_bytes, kv_cache.shape[0],
                                            self._device_id()), self._mem_type())
        return {"agent": self._agent.get_agent_metadata(), "base": kv_cache.data_ptr(),
                "device_id": self._device_id(), "mem": self._mem_type()}

    def _connect(self, peer: Peer) -> None:
        name = self._agent.add_remote_agent(peer.data["agent"])
        name = name.decode() if isinstance(name, bytes) else name  # NIXL returns bytes
        if name != peer.name:
            raise ValueError(f"NIXL agent {name!r} announced itself as {peer.name!r}")
        data = peer.data
        self._remote_blocks[peer.name] = self._agent.prep_xfer_dlist(
            peer.name, _block_descs(data["base"], self.compat.block_bytes, data["num_blocks"], data["device_id"]),
            data["mem"])

    def _warm(self, peer: Peer) -> None:
        self._agent.make_connection(peer.name)  # UCX endpoints, else made by the first write

    def _disconnect(self, name: str) -> None:
        dlist = self._remote_blocks.pop(name, None)
        if dlist is not None:
            self._agent.release_dlist_handle(dlist)
            self._agent.remove_remote_agent(name)

    def _start(self, peer: Peer, write: Write) -> None:
        src, dst = block_pairs(write.runs)
        handle = self._agent.make_prepped_xfer("WRITE", self._local_blocks, src, self._remote_blocks[peer.name],
                                               dst, self._header(write))
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
        pass  # NIXL delivered _header(write) with the data

    def _incoming_notifications(self) -> list[tuple[bytes, bytes]]:
        return [(sender.encode() if isinstance(sender, str) else sender, msg)
                for sender, msgs in self._agent.get_new_notifs().items() for msg in msgs]

    def _abandon(self, write: Write) -> None:
        if write.handle is not None:
            self._agent.release_xfer_handle(write.handle)
            write.handle = None

    def _close(self) -> None:
        for name, dlist in self._remote_blocks.items():
            self._agent.release_dlist_handle(dlist)
            self._agent.remove_remote_agent(name)
        self._remote_blocks.clear()
        if self._local_blocks is not None:
            self._agent.release_dlist_handle(self._local_blocks)
            self._local_blocks = None
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)


def _block_descs(base: int, block_bytes: int, num_blocks: int, device_id: int) -> np.ndarray:
    """[num_blocks, 3] (address, length, device id) rows, one per block."""
    rows = np.empty((num_blocks, 3), dtype=np.int64)
    rows[:, 0] = base + np.arange(num_blocks, dtype=np.int64) * block_bytes
    rows[:, 1] = block_bytes
    rows[:, 2] = device_id
    return rows
