"""What two workers must agree on before one may write KV blocks into the other."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

# The engine's cache layout (engine/kv_cache/layout.py). A block of every layer is one
# contiguous region, which is what lets a run of blocks be one descriptor; a slice of
# one block's heads is one contiguous region too (heads outside layers).
LAYOUT = "block_major:[blocks,kv_heads,layers,2,block_size,head_dim]"


class IncompatiblePeerError(ValueError):
    """A handshake whose compatibility record differs from ours; names the field."""


@dataclass(frozen=True)
class KVCompat:
    model: str
    dtype: str
    layout: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def from_cache(cls, kv_cache: torch.Tensor, model: str, tp_rank: int = 0,
                   tp_size: int = 1) -> "KVCompat":
        if kv_cache.dim() != 6 or kv_cache.shape[3] != 2:
            raise ValueError(f"expected a {LAYOUT} cache, got shape {tuple(kv_cache.shape)}")
        if not kv_cache.is_contiguous():
            raise ValueError("the KV cache must be contiguous to be registered for transfer")
        _, kv_heads, layers, _, block_size, head_dim = kv_cache.shape
        return cls(model, str(kv_cache.dtype).removeprefix("torch."), LAYOUT, block_size, layers,
                   kv_heads, head_dim, tp_rank, tp_size)

    @property
    def block_bytes(self) -> int:
        itemsize = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVCompat":
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            raise IncompatiblePeerError(f"malformed compatibility record: {d!r}")
        return cls(**d)

    def check_peer(self, peer: "KVCompat", peer_name: str) -> None:
        """Raise IncompatiblePeerError naming the first field that differs."""
        for f in dataclasses.fields(self):
            ours, theirs = getattr(self, f.name), getattr(peer, f.name)
            if ours != theirs:
                raise IncompatiblePeerError(
                    f"peer {peer_name!r} is incompatible: {f.name} is {theirs!r} there, "
                    f"{ours!r} here")
