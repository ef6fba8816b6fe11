"""Attention backends by name. The model calls store_kv then attention for each layer."""

from __future__ import annotations

import torch

from engine.attention import reference
from engine.attention.metadata import AttentionMetadata


class AttentionBackend:
    """The torch reference; kernel backends subclass and override both methods.

    Called by every attention layer inside attention_context(), once per forward:
    store_kv first (the new tokens' K/V must be visible to their own queries), then
    attention. Neither may synchronise with the host on the GPU path.
    """

    name = "torch"

    def store_kv(self, layer_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        reference.store_kv(layer_cache, key, value, slot_mapping)

    def attention(self, query: torch.Tensor, layer_cache: torch.Tensor, md: AttentionMetadata,
                  scale: float) -> torch.Tensor:
        return reference.paged_attention(query, layer_cache, md, scale)


BACKENDS: dict[str, type[AttentionBackend]] = {"torch": AttentionBackend}


def get_backend(name: str, device: str) -> AttentionBackend:
    """'auto' picks the torch reference on CPU (kernels register themselves for CUDA)."""
    if name == "auto":
        name = "triton" if device.startswith("cuda") and "triton" in BACKENDS else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(BACKENDS)}")
    return BACKENDS[name]()
