"""Paged decode attention: one query token per sequence over its block table.

Grid (sequence, KV head, split). A program loads the query heads that share its KV
head (GQA) as one [GROUPS_PAD, D] tile, so each K/V tile it reads serves all of
them, and walks its split's share of the context in tiles of TILE tokens gathered
through the block table (any block size). The loop is software-pipelined
(num_stages): the next tiles' loads are in flight while one is being reduced, which
is what keeps HBM busy.

Split-KV: split j covers tokens [j * split_tokens, (j + 1) * split_tokens) (the last
split also takes any remainder), each writes an unnormalised partial (acc, max, sum)
and _reduce_kernel merges them, so long contexts with few sequences still fill the
GPU. Split boundaries are fixed in tokens, not derived from the split count, so the
result depends only on the context: an extra, empty split adds exact zeros, and a
single split (written directly, no reduction) equals the reduction over one. Eager
steps and CUDA graphs (sized for longer contexts) therefore agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import (LaunchConfig, check_attention_io, check_index, dot_precision,
                                   native_dots, next_power_of_2)
from engine.kernels.online_softmax import load_kv_tile, online_softmax_step

SPLIT_TOKENS = 512  # context tokens per split

# Measured on an H200 (benchmarks/gpu_check.py --only tune): 84% of HBM bandwidth at
# batch 64, context 2k, head_dim 64 (90% at 128), against 70-77% for 32-token tiles and
# 65-72% for 8 warps. The interpreter on CPU runs small tiles (the unit tests cover both).
GPU_CONFIG = LaunchConfig(block_n=64, num_warps=2, num_stages=3)
CPU_CONFIG = LaunchConfig(block_n=32, num_warps=4, num_stages=1)


def default_config(device: torch.device) -> LaunchConfig:
    return GPU_CONFIG if device.type == "cuda" else CPU_CONFIG


@triton.jit
def _decode_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
                   q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, rows_ptr,
                   stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
                   stride_c_block, stride_c_kv, stride_c_slot, stride_c_head, stride_bt,
                   scale, num_splits,
                   GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
                   SPLIT: tl.constexpr, PRECISION: tl.constexpr, NATIVE: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(rows_ptr + seq).to(tl.int64)
    g = tl.arange(0, GROUPS_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUPS + g
    q = tl.load(q_ptr + token * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                mask=g[:, None] < GROUPS, other=0.0)
    if not NATIVE:
        q = q.to(tl.float32)

    num_tiles = tl.cdiv(seq_len, TILE)
    first = 0
    last = num_tiles
    if SPLIT:
        first = split * TILES_PER_SPLIT
        if split < num_splits - 1:
            last = tl.minimum(first + TILES_PER_SPLIT, num_tiles)

    m = tl.full([GROUPS_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUPS_PAD], tl.float32)
    acc = tl.zeros([GROUPS_PAD, HEAD_DIM], tl.float32)
    t = tl.arange(0, TILE)
    table = block_tables_ptr + seq * stride_bt
    for tile in range(first, last):
        pos = tile * TILE + t
        valid = pos < seq_len
        k, v = load_kv_tile(cache_ptr, table, pos, valid, kv_head, d, stride_c_block, stride_c_kv,
                            stride_c_slot, stride_c_head, BLOCK_SIZE, NATIVE)
        # Every tile holds a valid position, so each row's max is finite from the first.
        m, l, acc = online_softmax_step(q, k, v, valid[None, :], m, l, acc, scale, PRECISION)

    if SPLIT:
        # Partials are [seqs, q_heads, splits(, D)]; a split past the context leaves
        # max = -inf and sum = 0, which the reduction weighs as zero.
        part = (seq * (tl.num_programs(1) * GROUPS) + heads) * num_splits + split
        gmask = g < GROUPS
        tl.store(part_max_ptr + part, m, mask=gmask)
        tl.store(part_sum_ptr + part, l, mask=gmask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])
    else:
        out = acc / l[:, None]
        tl.store(out_ptr + token * stride_o_tok + heads[:, None] * stride_o_head + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g[:, None] < GROUPS)


@triton.jit
def _reduce_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, rows_ptr,
                   stride_o_tok, stride_o_head, num_q_heads, num_splits,
                   SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(rows_ptr + seq).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    part = (seq * num_q_heads + head) * num_splits + s
    smask = s < num_splits
    m = tl.load(part_max_ptr + part, mask=smask, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=smask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=smask[:, None], other=0.0)
    m_all = tl.max(m, 0)
    w = tl.where(smask & (l > 0), tl.exp(m - m_all), 0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + d, out.to(out_ptr.dtype.element_ty))


def num_splits_for(max_seq_len: int, split_tokens: int = SPLIT_TOKENS) -> int:
    """Splits that give every context up to max_seq_len its fixed-size splits."""
    return max(1, -(-max_seq_len // split_tokens))


def decode_attention(out: torch.Tensor, query: torch.Tensor, layer_cache: torch.Tensor,
                     rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, num_splits: int = 1, split_tokens: int = SPLIT_TOKENS,
                     config: LaunchConfig | None = None) -> None:
    """out[rows[i]] = attention of query[rows[i]] over seq_lens[i] cached tokens in the
    blocks block_tables[i], for each decode sequence i.

    out, query:   [T, Hq, D] (the flattened batch; only `rows` are read and written)
    layer_cache:  [num_blocks, 2, block_size, H, D], this step's K/V already stored
    rows:         [B] int32 token indices; block_tables [B, max_blocks] int32; seq_lens [B] int32
    num_splits:   num_splits_for(longest context) keeps results independent of it; fewer
                  is still correct (the last split takes the rest) but rounds differently
    config:       tiles and launch options (default_config: tuned for the GPU)
    """
    block_size, num_kv_heads, head_dim, num_q_heads = check_attention_io(out, query, layer_cache)
    device = layer_cache.device
    num_seqs = rows.shape[0]
    check_index("rows", rows, 1, torch.int32, device)
    check_index("block_tables", block_tables, 2, torch.int32, device, num_seqs)
    check_index("seq_lens", seq_lens, 1, torch.int32, device, num_seqs)
    config = config or default_config(layer_cache.device)
    tile = config.block_n
    if num_splits < 1 or split_tokens < tile or split_tokens % tile:
        raise ValueError(f"need num_splits >= 1 and split_tokens a multiple of the {tile}-token "
                         f"tile, got {num_splits} and {split_tokens}")
    if num_seqs == 0:
        return
    groups = num_q_heads // num_kv_heads
    cache_strides = layer_cache.stride()[:4]
    common = dict(GROUPS=groups, GROUPS_PAD=max(16, next_power_of_2(groups)), HEAD_DIM=head_dim,
                  BLOCK_SIZE=block_size, TILE=tile, TILES_PER_SPLIT=split_tokens // tile,
                  PRECISION=dot_precision(layer_cache.dtype), NATIVE=native_dots(layer_cache),
                  num_warps=config.num_warps, num_stages=config.num_stages)
    grid = (num_seqs, num_kv_heads, num_splits)
    if num_splits == 1:
        _decode_kernel[grid](out, out, out, out, query, layer_cache, block_tables, seq_lens, rows,
                             query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                             *cache_strides, block_tables.stride(0), scale, 1, SPLIT=False, **common)
        return
    part_acc = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    part_max = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    _decode_kernel[grid](out, part_acc, part_max, part_sum, query, layer_cache, block_tables, seq_lens,
                         rows, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                         *cache_strides, block_tables.stride(0), scale, num_splits, SPLIT=True, **common)
    _reduce_kernel[(num_seqs, num_q_heads)](out, part_acc, part_max, part_sum, rows,
                                            out.stride(0), out.stride(1), num_q_heads, num_splits,
                                            SPLITS_PAD=next_power_of_2(num_splits), HEAD_DIM=head_dim)
