"""nixl: NIXL agent with the UCX backend, one-sided WRITE (DRAM on CPU, VRAM on GPU).

Each write is one NIXL transfer whose descriptors are the write's runs (built locally
from the peer's base address and block size, never from NIXL's pickled descriptor
lists), and whose NIXL notification is our "written" message, delivered after the data.
NIXL has no timeouts of its own: the base class bounds every write.
"""

from __future__ import annotations

from typing import Any

import torch

from kv_transfer.base import KVTransport, TransportConfig, _Peer, _Write


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
        self._remote: dict[str, dict[str, Any]] = {}

    def _mem_type(self) -> str:
        return "VRAM" if self.kv_cache.is_cuda else "DRAM"

    def _device_id(self) -> int:
        return (self.kv_cache.device.index or 0) if self.kv_cache.is_cuda else 0

    def _register(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        self._registered = self._agent.register_memory(kv_cache)
        return {"agent": self._agent.get_agent_metadata(), "base": kv_cache.data_ptr(),
                "device_id": self._device_id(), "mem": self._mem_type()}

    def _connect(self, peer: _Peer) -> None:
        name = self._agent.add_remote_agent(peer.data["agent"])
        name = name.decode() if isinstance(name, bytes) else name  # NIXL returns bytes
        if name != peer.name:
            raise ValueError(f"NIXL agent {name!r} announced itself as {peer.name!r}")
        self._remote[peer.name] = peer.data

    def _start(self, peer: _Peer, write: _Write) -> None:
        bb, base, dev = self.compat.block_bytes, self.kv_cache.data_ptr(), self._device_id()
        remote = self._remote[peer.name]
        local = [(base + s * bb, n * bb, dev) for s, _, n in write.runs]
        dst = [(remote["base"] + d * bb, n * bb, remote["device_id"]) for _, d, n in write.runs]
        handle = self._agent.initialize_xfer(
            "WRITE", self._agent.get_xfer_descs(local, self._mem_type()),
            self._agent.get_xfer_descs(dst, remote["mem"]), peer.name, self._header(write))
        write.handle = handle
        if self._agent.transfer(handle) == "ERR":
            raise RuntimeError("NIXL refused to post the transfer")

    def _progress(self, write: _Write) -> bool:
        state = self._agent.check_xfer_state(write.handle)
        if state == "ERR":
            raise RuntimeError("NIXL transfer failed")
        if state != "DONE":
            return False
        self._agent.release_xfer_handle(write.handle)
        write.handle = None
        return True

    def _send_notification(self, peer: _Peer, write: _Write) -> None:
        pass  # NIXL delivered _header(write) with the data

    def _incoming_notifications(self) -> list[tuple[bytes, bytes]]:
        return [(sender.encode() if isinstance(sender, str) else sender, msg)
                for sender, msgs in self._agent.get_new_notifs().items() for msg in msgs]

    def _abandon(self, write: _Write) -> None:
        if write.handle is not None:
            self._agent.release_xfer_handle(write.handle)
            write.handle = None

    def _close(self) -> None:
        for name in self._remote:
            self._agent.remove_remote_agent(name)
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
        self._remote.clear()
