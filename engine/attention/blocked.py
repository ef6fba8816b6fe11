"""Batched decode attention in plain torch, computed block by block (fast on CPU).

The padded gather of the reference (every sequence padded to the longest context,
copied into fresh memory each layer) costs several times the KV bytes it needs.
Here every decode row's blocks are gathered once, as a ragged list of whole blocks,
and attention is a segmented softmax over blocks:

    K, V    [NB, bs, H, D]    the rows' blocks, concatenated (NB = sum of blocks per row)
    scores  [NB, H, G, bs]    q of the block's row . K, one batched matmul
    max/sum over the blocks of each row (scatter_reduce / index_add), then
    out     [B, H, G, D]      index_add of per-block p @ V, divided by the row's sum

G = query heads per KV head (GQA). Every block holds at least one valid position, so
each per-block max is finite and no NaN can appear from empty segments. With a
sliding window a row's blocks start at the one holding its window's first position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DecodePlan:
    """Built once per step, shared by all layers.

    rows:          [B] int64, token index (in the flattened batch) of each decode row
    blocks:        [NB] int64, block ids of all decode rows, row after row
    block_row:     [NB] int64, which decode row (0..B-1) each block belongs to
    invalid:       [NB, bs] bool, True for slots past the row's context length or
                   before its window
    edge_blocks:   [E] int64, index (into blocks) of the blocks with an invalid slot
    edge_invalid:  [E, bs] bool, invalid[edge_blocks]
    kv_buffer:     gathered K and V, allocated by the first layer, reused by the rest
    """

    rows: torch.Tensor
    blocks: torch.Tensor
    block_row: torch.Tensor
    invalid: torch.Tensor
    edge_blocks: torch.Tensor
    edge_invalid: torch.Tensor
    num_rows: int
    kv_buffer: torch.Tensor | None = None


def build_decode_plan(rows: list[int], block_tables: torch.Tensor, seq_lens: list[int],
                      block_size: int, window: int = 0) -> DecodePlan:
    """Plan for decode rows (one query token each): their token indices in the batch,
    their block tables (a row each) and context lengths; window > 0: each row sees only
    its last `window` positions, and blocks wholly before them are not gathered."""
    tables = block_tables.cpu()
    blocks, block_row, firsts, ends = [], [], [], []
    for r, seq_len in enumerate(seq_lens):
        start = max(0, seq_len - window) if window > 0 else 0
        b0, n = start // block_size, -(-seq_len // block_size)
        blocks.append(tables[r, b0:n].long())
        block_row += [r] * (n - b0)
        # Each block's valid slots [first, end): the window's first block starts at its
        # first position, the last block ends at the context's end.
        firsts += [start - b0 * block_size] + [0] * (n - b0 - 1)
        ends += [block_size] * (n - b0 - 1) + [seq_len - (n - 1) * block_size]
    device = block_tables.device
    slot = torch.arange(block_size)[None, :]
    invalid = (slot < torch.tensor(firsts)[:, None]) | (slot >= torch.tensor(ends)[:, None])
    edge = invalid.any(1).nonzero().flatten()
    return DecodePlan(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        blocks=torch.cat(blocks).to(device),
        block_row=torch.tensor(block_row, device=device),
        invalid=invalid.to(device),
        edge_blocks=edge.to(device),
        edge_invalid=invalid[edge].to(device),
        num_rows=len(rows),
    )


def blocked_decode_attention(query: torch.Tensor, layer_cache: torch.Tensor, plan: DecodePlan,
                             scale: float, softcap: float = 0.0) -> torch.Tensor:
    """query: [T, Hq, D]; returns [B, Hq, D] for the plan's rows, in plan order;
    softcap > 0: scores soft-capped to softcap * tanh(score / softcap)."""
    _, _, block_size, num_kv_heads, head_dim = layer_cache.shape
    num_blocks = plan.blocks.numel()
    q = query[plan.rows].view(plan.num_rows, num_kv_heads, -1, head_dim)  # [B, H, G, D]
    groups = q.shape[2]
    if plan.kv_buffer is None:
        # Reused by every layer of the step: fresh multi-MB tensors cost page faults.
        plan.kv_buffer = query.new_empty((2, num_blocks, block_size, num_kv_heads, head_dim))
    k, v = plan.kv_buffer[0], plan.kv_buffer[1]
    if layer_cache.dtype == query.dtype:
        torch.index_select(layer_cache[:, 0], 0, plan.blocks, out=k)  # [NB, bs, H, D]
        torch.index_select(layer_cache[:, 1], 0, plan.blocks, out=v)
    else:  # an fp8 cache (attention/kv_quant.py): gathered, then widened exactly
        k.copy_(torch.index_select(layer_cache[:, 0], 0, plan.blocks))
        v.copy_(torch.index_select(layer_cache[:, 1], 0, plan.blocks))
    # Slots past a row's end or before its window (only in its edge blocks) may hold
    # anything, even NaN, and 0 * NaN would poison p @ V.
    v[plan.edge_blocks] = v[plan.edge_blocks].masked_fill(plan.edge_invalid[:, :, None, None], 0.0)

    # Batched matmuls need a uniform batch stride, which (block, head) pairs lack in the
    # [NB, bs, H, D] layout. So multiply all heads against all heads in one bmm per block
    # ([bs*H, D] @ [D, H*G]) and keep the matching-head diagonal: H times the (small)
    # attention FLOPs, but no transposing copy of K or V.
    qb = q[plan.block_row].view(num_blocks, num_kv_heads * groups, head_dim)
    cross = torch.bmm(k.view(num_blocks, block_size * num_kv_heads, head_dim), qb.transpose(1, 2))
    cross = cross.view(num_blocks, block_size, num_kv_heads, num_kv_heads, groups)
    scores = cross.diagonal(dim1=2, dim2=3).permute(0, 3, 2, 1) * scale  # [NB, H, G, bs]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(plan.invalid[:, None, None, :], float("-inf"))
    block_max = scores.amax(-1)  # [NB, H, G]
    row_max = torch.full((plan.num_rows, num_kv_heads, groups), float("-inf"),
                         dtype=scores.dtype, device=scores.device)
    row_max.scatter_reduce_(0, plan.block_row[:, None, None].expand_as(block_max), block_max, "amax")
    p = torch.exp(scores - row_max[plan.block_row][..., None])  # [NB, H, G, bs]
    denom = torch.zeros_like(row_max).index_add_(0, plan.block_row, p.sum(-1))
    # Same trick for p @ V: a block-diagonal [H*G, bs*H] weight matrix per block.
    p_full = p.new_zeros((num_blocks, num_kv_heads, groups, block_size, num_kv_heads))
    p_full.diagonal(dim1=1, dim2=4).copy_(p.permute(0, 2, 3, 1))
    pv = torch.bmm(p_full.view(num_blocks, num_kv_heads * groups, block_size * num_kv_heads),
                   v.view(num_blocks, block_size * num_kv_heads, head_dim))
    out = torch.zeros((plan.num_rows, num_kv_heads * groups, head_dim), dtype=q.dtype, device=q.device)
    out.index_add_(0, plan.block_row, pv)
    out = out.view(plan.num_rows, num_kv_heads, groups, head_dim) / denom[..., None]
    return out.view(plan.num_rows, num_kv_heads * groups, head_dim)
