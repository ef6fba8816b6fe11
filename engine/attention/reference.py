"""Torch reference paged attention: runs on CPU and GPU, the oracle for kernels.

Each layer works on its strided view of the cache, [num_blocks, 2, bs, H, D]
(0 = K, 1 = V; engine/kv_cache/layout.py): index it, never .view() it. An fp8 cache
is written with values already on its grid and read back widened to the query's
dtype (attention/kv_quant.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.kv_quant import readable
from engine.attention.metadata import AttentionMetadata


def store_kv(layer_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new K/V ([T, H, D]) into the layer's cache at slot_mapping (-1 = skip)."""
    block_size = layer_cache.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    layer_cache[blocks, 0, offsets] = key.to(layer_cache.dtype)
    layer_cache[blocks, 1, offsets] = value.to(layer_cache.dtype)


def gather_kv(layer_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first seq_len tokens: each [seq_len, H, D], in the
    cache's dtype (an fp8 cache's widened to `dtype`)."""
    block_size = layer_cache.shape[2]
    blocks = block_table[:-(-seq_len // block_size)].long()
    # index_select writes a contiguous [n, bs, H, D] that views flat: one copy each.
    # (Indexing with [blocks] would keep the view's strides, heads outermost within a
    # block, and flattening blocks with slots would copy again.)
    k = torch.index_select(layer_cache[:, 0], 0, blocks).flatten(0, 1)[:seq_len]
    v = torch.index_select(layer_cache[:, 1], 0, blocks).flatten(0, 1)[:seq_len]
    return readable(k, dtype), readable(v, dtype)


def paged_attention(query: torch.Tensor, layer_cache: torch.Tensor, md: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Causal attention of new tokens over their sequence's cached + new context.

    query: [T, Hq, D] (T = md.query_start_loc[-1]); returns [T, Hq, D]. The new tokens'
    K/V must already be stored. Query i of a sequence with context L and q new tokens
    sits at position L - q + i and sees keys 0 .. L - q + i.
    """
    if md.is_pure_decode:
        return _decode(query, layer_cache, md, scale)
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
        k, v = gather_kv(layer_cache, md.block_tables[i], seq_len, query.dtype)
        out[start:start + q_len] = causal_attention(query[start:start + q_len], k, v, scale)
        start += q_len
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence: q [n, Hq, D] are the last n of the L positions of k, v [L, H, D]."""
    n, seq_len = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    # Batched 4-D inputs with K/V heads repeated (as transformers does) take torch's
    # fused CPU flash kernel; 3-D or enable_gqa inputs fall back to the slower math path.
    q = q.transpose(0, 1)[None]
    k = k.transpose(0, 1).repeat_interleave(groups, dim=0)[None]
    v = v.transpose(0, 1).repeat_interleave(groups, dim=0)[None]
    if n == seq_len:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        pos = torch.arange(seq_len - n, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


def _decode(query: torch.Tensor, layer_cache: torch.Tensor, md: AttentionMetadata,
            scale: float) -> torch.Tensor:
    """One query token per sequence, batched over a padded gather of all contexts."""
    block_size = layer_cache.shape[2]
    max_len = max(md.seq_lens_cpu)
    tables = md.block_tables[:, :-(-max_len // block_size)].long()
    k = readable(layer_cache[:, 0][tables].flatten(1, 2)[:, :max_len], query.dtype)  # [B, L, H, D], a fresh copy
    v = readable(layer_cache[:, 1][tables].flatten(1, 2)[:, :max_len], query.dtype)
    mask = torch.arange(max_len, device=query.device)[None, :] < md.seq_lens[:, None]
    # Slots past a sequence's end hold another request's data (or NaN/inf garbage);
    # masking scores is not enough, since 0 * inf = NaN in the weighted sum.
    k.masked_fill_(~mask[:, :, None, None], 0.0)
    v.masked_fill_(~mask[:, :, None, None], 0.0)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, H, L, D]
    q = query[:, :, None, :]  # [B, Hq, 1, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                       enable_gqa=True)
    return o[:, :, 0, :]
