"""KV transfer: moving a request's prompt KV blocks from a prefill worker's cache into
the blocks a decode worker reserved for it (push, one descriptor per run of blocks).

The interface is in base.py (who calls what, and the hooks a transport implements),
composed of control.py (sockets, peers, handshake), sender.py (P's writes) and
receiver.py (D's reservations, and who owns cancellation); events.py holds what poll()
reports. Transports register here by name.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module

from kv_transfer.base import KVTransport, TransportConfig
from kv_transfer.compat import IncompatiblePeerError, KVCompat
from kv_transfer.events import Completed, Event, Expired, Overwritten, Received, Released, WriteDone, WriteFailed

# name -> "module:Class"; imported on first use so a transport's library (nixl, torch
# distributed) loads only when it is chosen.
TRANSPORTS: dict[str, str] = {
    "tcp": "kv_transfer.tcp:TcpTransport",
    "shm": "kv_transfer.shm:ShmTransport",
    "nixl": "kv_transfer.nixl:NixlTransport",
    "nccl": "kv_transfer.nccl:NcclTransport",
    "cuda_ipc": "kv_transfer.cuda_ipc:CudaIpcTransport",
}
GPU_ONLY = frozenset({"cuda_ipc"})
CPU_ONLY = frozenset({"shm"})


def create_transport(name: str, agent_name: str, config: TransportConfig | None = None) -> KVTransport:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; available: {sorted(TRANSPORTS)}")
    module, cls = TRANSPORTS[name].split(":")
    factory: Callable[..., KVTransport] = getattr(import_module(module), cls)
    return factory(agent_name, config)


__all__ = ["TRANSPORTS", "GPU_ONLY", "CPU_ONLY", "create_transport", "KVTransport", "TransportConfig", "KVCompat",
           "IncompatiblePeerError", "Event", "WriteDone", "WriteFailed", "Received", "Completed",
           "Expired", "Released", "Overwritten"]
