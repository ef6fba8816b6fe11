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


def window_start(position: int, window: int) -> int:
    """The first key a query at `position` sees: transformers' sliding window keeps
    keys j with position - window < j <= position (window 0: every key)."""
    return max(0, position - window + 1) if window > 0 else 0


def gather_kv(layer_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              dtype: torch.dtype = torch.float32, first_block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's tokens [first_block * block_size, seq_len): each
    [n, H, D], in the cache's dtype (an fp8 cache's widened to `dtype`). Blocks before
    first_block are never read: a sliding window's may already be freed."""
    block_size = layer_cache.shape[2]
    blocks = block_table[first_block:-(-seq_len // block_size)].long()
    seq_len -= first_block * block_size
    # index_select writes a contiguous [n, bs, H, D] that views flat: one copy each.
    # (Indexing with [blocks] would keep the view's strides, heads outermost within a
    # block, and flattening blocks with slots would copy again.)
    k = torch.index_select(layer_cache[:, 0], 0, blocks).flatten(0, 1)[:seq_len]
    v = torch.index_select(layer_cache[:, 1], 0, blocks).flatten(0, 1)[:seq_len]
    return readable(k, dtype), readable(v, dtype)


def paged_attention(query: torch.Tensor, layer_cache: torch.Tensor, md: AttentionMetadata,
                    scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of new tokens over their sequence's cached + new context.

    query: [T, Hq, D] (T = md.query_start_loc[-1]); returns [T, Hq, D]. The new tokens'
    K/V must already be stored. Query i of a sequence with context L and q new tokens
    sits at position L - q + i and sees keys 0 .. L - q + i (with a sliding window of
    W > 0, only the last W of them). softcap > 0: scores are soft-capped (Gemma 2).
    """
    if md.is_pure_decode:
        return _decode(query, layer_cache, md, scale, window, softcap)
    out = torch.empty_like(query)
    start = 0
    block_size = layer_cache.shape[2]
    for i, (q_len, seq_len) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
        first = window_start(seq_len - q_len, window) // block_size
        k, v = gather_kv(layer_cache, md.block_tables[i], seq_len, query.dtype, first)
        out[start:start + q_len] = causal_attention(query[start:start + q_len], k, v, scale, window, softcap)
        start += q_len
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One sequence: q [n, Hq, D] are the last n of the L positions of k, v [L, H, D];
    with window W > 0 each query sees only the last W of its positions."""
    n, seq_len = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    # Batched 4-D inputs with K/V heads repeated (as transformers does) take torch's
    # fused CPU flash kernel; 3-D or enable_gqa inputs fall back to the slower math path.
    q = q.transpose(0, 1)[None]
    k = k.transpose(0, 1).repeat_interleave(groups, dim=0)[None]
    v = v.transpose(0, 1).repeat_interleave(groups, dim=0)[None]
    if n == seq_len and not 0 < window < seq_len and not softcap:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        pos = torch.arange(seq_len - n, seq_len, device=q.device)
        keys = torch.arange(seq_len, device=q.device)[None, :]
        mask = keys <= pos[:, None]
        if window > 0:
            mask &= keys > pos[:, None] - window
        o = masked_attention(q, k, v, mask, scale, softcap)
    return o[0].transpose(0, 1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     softcap: float = 0.0) -> torch.Tensor:
    """Softmax attention [..., n, D] of q [..., n, D] over k, v [..., L, D] where `mask`
    (broadcast to [..., n, L]) is True. softcap > 0: each score x is first capped to
    softcap * tanh(x / softcap), as Gemma 2 does, which SDPA cannot: then computed
    as transformers' eager attention does (softmax in float32)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.tanh((q @ k.transpose(-1, -2)) * (scale / softcap)) * softcap
    p = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    return p @ v


def _decode(query: torch.Tensor, layer_cache: torch.Tensor, md: AttentionMetadata,
            scale: float, window: int, softcap: float) -> torch.Tensor:
    """One query token per sequence, batched over a padded gather of all contexts."""
    block_size = layer_cache.shape[2]
    max_len = max(md.seq_lens_cpu)
    tables = md.block_tables[:, :-(-max_len // block_size)].long()
    k = readable(layer_cache[:, 0][tables].flatten(1, 2)[:, :max_len], query.dtype)  # [B, L, H, D], a fresh copy
    v = readable(layer_cache[:, 1][tables].flatten(1, 2)[:, :max_len], query.dtype)
    keys = torch.arange(max_len, device=query.device)[None, :]
    mask = keys < md.seq_lens[:, None]
    if window > 0:
        mask &= keys >= md.seq_lens[:, None] - window
    # Slots past a sequence's end (or before its window, maybe freed) hold another
    # request's data or NaN/inf garbage; masking scores is not enough, since 0 * inf =
    # NaN in the weighted sum.
    k.masked_fill_(~mask[:, :, None, None], 0.0)
    v.masked_fill_(~mask[:, :, None, None], 0.0)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, H, L, D]
    q = query[:, :, None, :]  # [B, Hq, 1, D]
    if softcap:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return masked_attention(q, k, v, mask[:, None, None, :], scale, softcap)[:, :, 0, :]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                       enable_gqa=True)
    return o[:, :, 0, :]
