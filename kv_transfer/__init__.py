"""KV transfer: moving a request's prompt KV blocks from a prefill worker's cache into
the blocks a decode worker reserved for it (push, one descriptor per run of blocks).

The interface is in base.py (who calls what, and the hooks a transport implements),
composed of control.py (sockets, peers, handshake), sender.py (P's writes) and
receiver.py (D's reservations, and who owns cancellation); events.py holds what poll()
reports. Transports register here by name.

KVTransport, KVCompat and IncompatiblePeerError load on first use (PEP 562): they
import torch, and the cluster config and the router's process import this package
without loading torch.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import TYPE_CHECKING, Any

from kv_transfer.config import TransportConfig
from kv_transfer.events import Completed, Event, Expired, Overwritten, Received, Released, WriteDone, WriteFailed

if TYPE_CHECKING:
    from kv_transfer.base import KVTransport
    from kv_transfer.compat import IncompatiblePeerError, KVCompat

# name -> the module it is defined in, imported when the name is first used
_LAZY = {"KVTransport": "kv_transfer.base", "IncompatiblePeerError": "kv_transfer.compat",
         "KVCompat": "kv_transfer.compat"}

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


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
