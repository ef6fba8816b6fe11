"""Write this step's K/V into the paged cache at slot_mapping (-1 = padding, skipped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import check_index, check_layer_cache, check_tokens, next_power_of_2


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr,
                     stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                     stride_c_block, stride_c_kv, stride_c_slot, stride_c_head,
                     NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = (h < NUM_HEADS) & (slot >= 0)
    block = tl.maximum(slot, 0) // BLOCK_SIZE
    dst = cache_ptr + block * stride_c_block + (slot % BLOCK_SIZE) * stride_c_slot + h * stride_c_head + d
    k = tl.load(key_ptr + token * stride_k_tok + h * stride_k_head + d, mask=mask)
    v = tl.load(value_ptr + token * stride_v_tok + h * stride_v_head + d, mask=mask)
    # An fp8 cache takes values already on its grid (attention/kv_quant.py): exact.
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(layer_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """layer_cache [num_blocks, 2, block_size, H, D]; key, value [T, H, D] in the cache's
    dtype (a 16- or 32-bit one for an fp8 cache); slot_mapping [T] int64 (block_id * block_size + offset, or -1)."""
    block_size, num_heads, head_dim = check_layer_cache(layer_cache)
    check_tokens("key", key, num_heads, head_dim, layer_cache.device, layer_cache.dtype)
    check_tokens("value", value, num_heads, head_dim, layer_cache.device, layer_cache.dtype)
    check_index("slot_mapping", slot_mapping, 1, torch.int64, layer_cache.device, key.shape[0])
    if key.shape[0] == 0:
        return
    _store_kv_kernel[(key.shape[0],)](
        key, value, layer_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *layer_cache.stride()[:4],
        NUM_HEADS=num_heads, HEADS_PAD=next_power_of_2(num_heads), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size)
