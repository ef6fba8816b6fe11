"""cuda_ipc: same host, GPU. The receiver exports its KV cache's CUDA memory as an IPC
handle; the sender opens it, and a write is one kernel launch that copies all of its
blocks (block_copy.py) on a dedicated stream. One-sided, like shm. Only between
processes: CUDA cannot open a handle in the process that made it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kv_transfer.base import KVTransport, TransportConfig
from kv_transfer.block_copy import as_words, copy_blocks
from kv_transfer.control import Peer
from kv_transfer.runs import block_pairs
from kv_transfer.sender import Write


class CudaIpcTransport(KVTransport):
    name = "cuda_ipc"
    one_sided = True

    def __init__(self, agent_name: str, config: TransportConfig | None = None) -> None:
        super().__init__(agent_name, config)
        self._peer_words: dict[str, torch.Tensor] = {}
        self._peer_layers: dict[str, torch.Tensor] = {}  # the peer's cache as [blocks, heads, layers, bytes]
        self._words: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None

    def _register(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        if not kv_cache.is_cuda:
            raise ValueError("the cuda_ipc transport needs a CUDA cache (use shm on CPU)")
        if kv_cache.storage_offset() != 0:
            raise ValueError("the cuda_ipc transport needs a cache that starts its storage")
        self._stream = torch.cuda.Stream(kv_cache.device)
        self._words = as_words(self._blocks_bytes)
        # Compile the copy kernel now rather than inside the first request's transfer:
        # block 0 onto itself changes nothing.
        zero = torch.zeros(1, dtype=torch.int32, device=kv_cache.device)
        copy_blocks(self._words, self._words, zero, zero)
        # Plain values only (ints, bytes, bools): msgpack, never pickle.
        handle = kv_cache.untyped_storage()._share_cuda_()
        return {"handle": list(handle), "device": kv_cache.device.index or 0,
                "bytes": kv_cache.numel() * kv_cache.element_size()}

    def _connect(self, peer: Peer) -> None:
        storage = torch.UntypedStorage._new_shared_cuda(*peer.data["handle"])
        raw = torch.empty(0, dtype=torch.uint8, device=f"cuda:{peer.data['device']}").set_(storage)
        rows = raw[:peer.data["bytes"]].view(peer.data["num_blocks"], -1)
        self._peer_words[peer.name] = as_words(rows)
        self._peer_layers[peer.name] = rows.view(rows.shape[0], peer.compat.local_heads[0], peer.compat.num_layers, -1)

    def _disconnect(self, name: str) -> None:
        assert self._stream is not None  # made by _register, before any peer was added
        self._stream.synchronize()  # no queued copy may still target the mapping
        self._peer_words.pop(name, None)
        self._peer_layers.pop(name, None)

    def _start(self, peer: Peer, write: Write) -> None:
        dst, src = self._peer_words[peer.name], self._words
        assert src is not None and self._stream is not None  # made by _register, before any peer was added
        # The source blocks were written by the compute stream: order after it.
        self._stream.wait_stream(torch.cuda.current_stream(self.registered_cache.device))
        with torch.cuda.stream(self._stream):
            if write.layers is not None:  # a layer range: a strided copy per run (heads apart in each block)
                l0, l1 = write.layers
                to, frm = self._peer_layers[peer.name], self._rank_layers[0]
                for s, d, n in write.runs:
                    to[d:d + n, :, l0:l1].copy_(frm[s:s + n, :, l0:l1], non_blocking=True)
            else:
                ids = torch.from_numpy(np.stack(block_pairs(write.runs)))
                ids = ids.pin_memory().to(self.registered_cache.device, non_blocking=True)
                copy_blocks(src, dst, ids[0], ids[1])
            event = torch.cuda.Event()
            event.record(self._stream)
        write.handle = event

    def _progress(self, write: Write) -> bool:
        return write.handle.query()

    def _close(self) -> None:
        self._peer_words.clear()
        self._peer_layers.clear()

