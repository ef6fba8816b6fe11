"""The paged KV cache's memory layout: one tensor for all layers, and each layer's view.

    kv_cache    [num_blocks, num_kv_heads, num_layers, planes, block_size, head_dim]
                                                      ^ 0 = K, 1 = V
    layer view  [num_blocks, 2, block_size, num_kv_heads, head_dim]  (strided, no copy)

Block-major: a block of every head and layer is one contiguous region, so a run of
consecutive blocks moves between workers as one descriptor. Heads outside layers: the
heads [h0, h1) of one block are one contiguous region too, which is what a worker of
another tensor-parallel size reads or writes when it holds a different head slice.
Within a block, one head's K (then V) of one layer is block_size * head_dim contiguous
elements.

Multi-head latent attention (DeepSeek, engine/model/mla.py) keeps one plane: one latent
vector per token and layer, a single "KV head" every rank holds whole. Its layer view
still has two planes, K and V both that latent (stride 0 between them: the latent is
attended as key and as value, engine/model/mla.py says why), so every backend reads it
as it reads a K/V cache; writing the same latent as K and as V writes it once.

The layer view is what every attention backend takes. Its head stride is not head_dim
(heads are far apart), so backends must index it by its strides and never .view() it.
kv_transfer/compat.py names this layout in its handshake and must change with it.
"""

from __future__ import annotations

import torch


def cache_shape(num_blocks: int, num_kv_heads: int, num_layers: int, block_size: int,
                head_dim: int, planes: int = 2) -> tuple[int, int, int, int, int, int]:
    if planes not in (1, 2):
        raise ValueError(f"a KV cache has 2 planes (K, V) or 1 (a latent), not {planes}")
    return (num_blocks, num_kv_heads, num_layers, planes, block_size, head_dim)


def layer_view(kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """kv_cache [num_blocks, H, num_layers, planes, bs, D] -> layer `layer` as [num_blocks, 2, bs, H, D]."""
    layer_cache = kv_cache[:, :, layer]
    if layer_cache.shape[2] == 1:  # one latent plane: read as both K and V
        layer_cache = layer_cache.expand(-1, -1, 2, -1, -1)
    return layer_cache.permute(0, 2, 3, 1, 4)
