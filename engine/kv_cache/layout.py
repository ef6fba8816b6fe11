"""The paged KV cache's memory layout: one tensor for all layers, and each layer's view.

    kv_cache    [num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]
                                                      ^ 0 = K, 1 = V
    layer view  [num_blocks, 2, block_size, num_kv_heads, head_dim]  (strided, no copy)

Block-major: a block of every head and layer is one contiguous region, so a run of
consecutive blocks moves between workers as one descriptor. Heads outside layers: the
heads [h0, h1) of one block are one contiguous region too, which is what a worker of
another tensor-parallel size reads or writes when it holds a different head slice.
Within a block, one head's K (then V) of one layer is block_size * head_dim contiguous
elements.

The layer view is what every attention backend takes. Its head stride is not head_dim
(heads are far apart), so backends must index it by its strides and never .view() it.
kv_transfer/compat.py names this layout in its handshake and must change with it.
"""

from __future__ import annotations

import torch


def cache_shape(num_blocks: int, num_kv_heads: int, num_layers: int, block_size: int,
                head_dim: int) -> tuple[int, int, int, int, int, int]:
    return (num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim)


def layer_view(kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """kv_cache [num_blocks, H, num_layers, 2, bs, D] -> layer `layer` as [num_blocks, 2, bs, H, D]."""
    return kv_cache[:, :, layer].permute(0, 2, 3, 1, 4)
