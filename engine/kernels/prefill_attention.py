"""Varlen causal prefill attention over the paged cache.

A flattened batch of sequences, each with q_len new tokens after a cached context of
seq_len - q_len tokens (0 for a fresh prompt; a prefix-cache hit or earlier chunks
otherwise). The new tokens' K/V are stored first, so every key is read through the
block table: one code path for fresh prompts, cached prefixes and chunks.

Grid (query tile, query head). The launcher lists each sequence's tiles of block_m
query tokens on the host (it knows the lengths), so no program is wasted on padding.
Query i of a sequence sits at position context + i and sees keys 0..context + i, or
with a sliding window W only the last W of them (context + i - W < key); a tile's
key loop then starts at its first query's window.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from engine.kernels.common import (
    LaunchConfig,
    check_attention_io,
    check_index,
    check_softcap,
    dot_precision,
    kernel_window,
    native_dots,
)
from engine.kernels.online_softmax import load_kv_tile, online_softmax_step

# The GPU tiles are the winner of the tile sweep (benchmarks/gpu_check.py --only tune) on
# an H200; its figures are in docs/benchmarks/2026-11-30-gpu-check-h200.md. Small tiles on CPU.
GPU_CONFIG = LaunchConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
CPU_CONFIG = LaunchConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)


def default_config(device: torch.device) -> LaunchConfig:
    return GPU_CONFIG if device.type == "cuda" else CPU_CONFIG


@triton.jit
def _prefill_kernel(out_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
                    tile_seq_ptr, tile_start_ptr,
                    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
                    stride_c_block, stride_c_kv, stride_c_slot, stride_c_head, stride_bt, scale, window,
                    softcap, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                    NATIVE: tl.constexpr, SOFTCAP: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUPS
    seq = tl.load(tile_seq_ptr + tile)
    q_first = tl.load(tile_start_ptr + tile)  # index of the tile's first query in its sequence
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    i = q_first + tl.arange(0, BLOCK_M)
    q_valid = i < q_len
    q_pos = context + i
    d = tl.arange(0, HEAD_DIM)
    tokens = (q_begin + i).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
                mask=q_valid[:, None], other=0.0)
    if not NATIVE:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    n = tl.arange(0, BLOCK_N)
    # Keys past the tile's last query are masked for all of its rows: stop there. Keys
    # before its first query's window are masked for all of them: start at that tile
    # (window is 2**30 when the layer has none).
    end = tl.minimum(seq_len, context + q_first + BLOCK_M)
    lo = tl.maximum(context + q_first - window + 1, 0)
    for start in range((lo // BLOCK_N) * BLOCK_N, end, BLOCK_N):
        pos = start + n
        # Not loaded before lo either: those blocks may be freed, holding anything.
        k_valid = (pos < end) & (pos >= lo)
        k, v = load_kv_tile(cache_ptr, table, pos, k_valid, kv_head, d, stride_c_block, stride_c_kv,
                            stride_c_slot, stride_c_head, BLOCK_SIZE, NATIVE)
        # Each row sees its own position, so no row's max stays -inf to the end.
        visible = k_valid[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        m, l, acc = online_softmax_step(q, k, v, visible, m, l, acc, scale, softcap, PRECISION, SOFTCAP)

    out = acc / l[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_o_tok + head * stride_o_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_valid[:, None])


def plan_tiles(query_lens: Sequence[int], seq_ids: Sequence[int],
               block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, first query) of every block_m-query tile of the given sequences, on
    the host: int32 arrays for prefill_attention's tile_seq and tile_start (launched
    with a config of the same block_m)."""
    tile_seq: list[int] = []
    tile_start: list[int] = []
    for s in seq_ids:
        starts = range(0, query_lens[s], block_m)
        tile_seq += [s] * len(starts)
        tile_start += starts
    return np.asarray(tile_seq, dtype=np.int32), np.asarray(tile_start, dtype=np.int32)


def prefill_attention(out: torch.Tensor, query: torch.Tensor, layer_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, tile_seq: torch.Tensor,
                      tile_start: torch.Tensor, scale: float, config: LaunchConfig | None = None,
                      window: int = 0, softcap: float = 0.0) -> None:
    """Causal attention for the query tiles listed by (tile_seq, tile_start) (from
    plan_tiles), written into out at their tokens; other rows of out are untouched.

    out, query:      [T, Hq, D]
    layer_cache:     [num_blocks, 2, block_size, H, D], this step's K/V already stored
    block_tables:    [S, max_blocks] int32; seq_lens [S] int32 (context + new tokens)
    query_start_loc: [S + 1] int32, cumulative new-token counts
    config:          tiles and launch options (default_config); plan_tiles with its block_m
    window:          > 0: a sliding window, each query sees its last `window` positions
    softcap:         > 0: scores soft-capped to softcap * tanh(score / softcap) (Gemma 2)
    """
    block_size, num_kv_heads, head_dim, num_q_heads = check_attention_io(out, query, layer_cache)
    device = layer_cache.device
    num_seqs = seq_lens.shape[0]
    check_index("block_tables", block_tables, 2, torch.int32, device, num_seqs)
    check_index("seq_lens", seq_lens, 1, torch.int32, device)
    check_index("query_start_loc", query_start_loc, 1, torch.int32, device, num_seqs + 1)
    check_index("tile_seq", tile_seq, 1, torch.int32, device)
    check_index("tile_start", tile_start, 1, torch.int32, device, tile_seq.shape[0])
    if tile_seq.shape[0] == 0:
        return
    config = config or default_config(layer_cache.device)
    _prefill_kernel[(tile_seq.shape[0], num_q_heads)](
        out, query, layer_cache, block_tables, seq_lens, query_start_loc, tile_seq, tile_start,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *layer_cache.stride()[:4], block_tables.stride(0), scale, kernel_window(window), softcap,
        GROUPS=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, PRECISION=dot_precision(query.dtype),
        NATIVE=native_dots(layer_cache, query), SOFTCAP=check_softcap(softcap) > 0, num_warps=config.num_warps,
        num_stages=config.num_stages)
