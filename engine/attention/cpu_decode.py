"""Loads the C decode-attention kernel (csrc/paged_decode.c) and checks its inputs.

The kernel is built on first use (engine/native.py); where it cannot be, `load()`
returns None and the caller keeps its plain-torch path.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from engine.attention.kv_quant import fp8_table, is_fp8
from engine.native import load_kernel, omp_threads

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
MAX_QUERY_HEADS, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 64, 256, 128  # the C file's stack arrays
WIDENED = (torch.bfloat16, torch.float16)  # query dtypes taken (as float32) over an fp8 cache


@cache
def load() -> ctypes.CDLL | None:
    lib = load_kernel(SOURCE)
    if lib is not None:
        lib.paged_decode_attention.restype = None
    return lib


@cache
def _table(dtype: torch.dtype) -> torch.Tensor:
    return fp8_table(dtype)


def supports(layer_cache: torch.Tensor, num_query_heads: int, query_dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernel handles this cache: float32 or fp8 on CPU, each head's dims contiguous
    (the kernel takes the block, K/V, slot and head strides as they are), shapes within
    its limits; queries in float32, or in 16 bits over an fp8 cache (the kernel computes
    in float32: the rows are widened and the result narrowed, cheaper than the torch path
    widening the whole cache)."""
    _, _, block_size, num_kv_heads, head_dim = layer_cache.shape
    groups = num_query_heads // num_kv_heads
    return (layer_cache.device.type == "cpu"
            and (query_dtype == torch.float32 or (is_fp8(layer_cache.dtype) and query_dtype in WIDENED))
            and (layer_cache.dtype == torch.float32 or is_fp8(layer_cache.dtype))
            and layer_cache.stride(-1) == 1
            and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM
            and groups <= MAX_QUERY_HEADS and block_size <= MAX_BLOCK_SIZE)


def paged_decode_attention(query: torch.Tensor, layer_cache: torch.Tensor, rows: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    query:        [T, Hq, D] float32; the decode rows are query[rows]
    layer_cache:  [num_blocks, 2, block_size, H, D], one layer's view of the cache:
                  float32, or fp8 (its values as stored: kv_quant's scales are the caller's)
    rows:         [B] int64 token indices into query
    block_tables: [B, max_blocks] int32, contiguous, one per row
    seq_lens:     [B] int32 context lengths (including the query token, already stored)
    window:       > 0: a sliding window, each row attends over its last `window` tokens
    softcap:      > 0: scores soft-capped to softcap * tanh(score / softcap) (Gemma 2)
    Returns [B, Hq, D].
    """
    lib = load()
    if lib is None:
        raise RuntimeError(f"the C decode kernel could not be built from {SOURCE}")
    num_tokens, num_heads, head_dim = query.shape
    _, two, block_size, num_kv_heads, cache_head_dim = layer_cache.shape
    if two != 2 or cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not match layer cache {tuple(layer_cache.shape)}")
    if not supports(layer_cache, num_heads):
        raise ValueError(f"unsupported cache for the C decode kernel: dtype {layer_cache.dtype}, "
                         f"device {layer_cache.device}, shape {tuple(layer_cache.shape)}, "
                         f"strides {layer_cache.stride()}")
    if not supports(layer_cache, num_heads, query.dtype) or query.stride(-1) != 1 or query.stride(-2) != head_dim:
        raise ValueError(f"query must be float32 (or 16-bit over an fp8 cache) with contiguous heads, got {query.dtype} "
                         f"strides {query.stride()}")
    num_rows = rows.numel()
    for name, t, dtype in (("rows", rows, torch.int64), ("block_tables", block_tables, torch.int32),
                           ("seq_lens", seq_lens, torch.int32)):
        if t.dtype != dtype or not t.is_contiguous() or t.shape[0] != num_rows:
            raise ValueError(f"{name} must be a contiguous {dtype} tensor with {num_rows} rows, "
                             f"got {t.dtype} {tuple(t.shape)}")
    narrow = query.dtype
    if narrow != torch.float32:  # 16-bit rows over an fp8 cache
        query = query[rows].float()
        rows = torch.arange(num_rows)
    out = torch.empty((num_rows, num_heads, head_dim), dtype=torch.float32)
    if num_rows == 0:
        return out.to(narrow)
    # Whole rows walk each block table once for all heads; split heads only when rows
    # are too few to give every thread work, or too many query heads for one item.
    groups = num_heads // num_kv_heads
    splits = 1
    while (splits < num_kv_heads and (num_rows * splits < 4 * torch.get_num_threads()
                                      or -(-num_kv_heads // splits) * groups > MAX_QUERY_HEADS)):
        splits += 1
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    s_block, s_kv, s_slot, s_head, _ = layer_cache.stride()
    lut = _table(layer_cache.dtype) if is_fp8(layer_cache.dtype) else None
    lib.paged_decode_attention(
        ptr(out.data_ptr()), ptr(query.data_ptr()), ptr(rows.data_ptr()), i64(query.stride(0)),
        ptr(layer_cache.data_ptr()), ctypes.c_int(layer_cache.element_size()),
        ptr(None if lut is None else lut.data_ptr()), i64(s_block), i64(s_kv), i64(s_slot), i64(s_head),
        ptr(block_tables.data_ptr()), i64(block_tables.stride(0)), ptr(seq_lens.data_ptr()),
        ctypes.c_int32(max(window, 0)), ctypes.c_int(num_rows), ctypes.c_int(num_kv_heads), ctypes.c_int(groups),
        ctypes.c_int(head_dim), ctypes.c_int(block_size), ctypes.c_float(scale), ctypes.c_float(softcap),
        ctypes.c_int(splits), omp_threads())
    return out.to(narrow)
