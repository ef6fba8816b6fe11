"""The MLA decode and fused MoE Triton kernels against their torch references, under
TRITON_INTERPRET=1 on CPU (tests/conftest.py turns it on).

MLA: each sequence's latents sit in random blocks of a NaN-poisoned 3-layer latent
cache (the other layers and the unused slots stay NaN), contexts end on and just past
block and tile boundaries, and the output is poisoned too, so a read of an unwritten
slot or an unwritten output fails. MoE: routing is skewed so that one expert's run
spans several tiles and another expert gets no token, and the expert-parallel slice
(first=4) leaves half the slots to another rank. Shapes stay small: the interpreter
costs about a millisecond per program. bfloat16 gets loose tolerances: the interpreter
truncates float32 -> bfloat16 instead of rounding.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.fused_moe import MoEConfig, align_by_expert, fused_moe, fused_moe_reference
from engine.kernels.mla_decode import mla_decode_attention, mla_decode_reference

LORA, ROPE = 32, 16
MLA_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
MOE_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def latent_cache(seq_lens: list[int], block_size: int, dtype: torch.dtype, seed: int = 0):
    """Layer 1's view of a NaN-filled [blocks, 1, 3 layers, 1, bs, D] latent cache, with
    each sequence's latents in random blocks. Returns (view, block_tables, latents)."""
    g = torch.Generator().manual_seed(seed)
    dim = LORA + ROPE
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    raw = torch.full((num_blocks, 1, 3, 1, block_size, dim), float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    # One spare column past every table: it points at a poisoned block.
    tables = torch.full((len(seq_lens), max(per_seq) + 1), perm[-1], dtype=torch.int32)
    latents = []
    for i, (n, nb) in enumerate(zip(seq_lens, per_seq)):
        tables[i, :nb] = torch.tensor([perm.pop(0) for _ in range(nb)], dtype=torch.int32)
        latent = torch.randn(n, dim, generator=g).to(dtype)
        pos = torch.arange(n)
        raw[tables[i].long()[pos // block_size], 0, 1, 0, pos % block_size] = latent
        latents.append(latent)
    view = raw[:, :, 1].expand(-1, -1, 2, -1, -1).permute(0, 2, 3, 1, 4)
    return view, tables, latents


def dense_mla(q: torch.Tensor, latent: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, D], latent [n, D] -> [H, LORA] in float32."""
    k = latent.float()
    if not len(k):
        return torch.zeros(q.shape[0], LORA)
    return (q.float() @ k.T * scale).softmax(-1) @ k[:, :LORA]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", [4, 20])  # within one 16-head program; over two, the second partial
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_decode_matches_reference(dtype: torch.dtype, block_size: int, heads: int, num_splits: int) -> None:
    # One token, tile and block edges (16-token tiles), a long context, and an empty
    # padding row (zeros, not NaN).
    seq_lens = [1, 5, 16, 17, 40, 0]
    cache, tables, latents = latent_cache(seq_lens, block_size, dtype)
    assert cache.stride(1) == 0 and cache.shape == (cache.shape[0], 2, block_size, 1, LORA + ROPE)
    g = torch.Generator().manual_seed(1)
    query = torch.randn(len(seq_lens), heads, LORA + ROPE, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = (LORA + ROPE) ** -0.5 * 2  # sharper than uniform
    out = torch.full((len(seq_lens), heads, LORA), float("nan"), dtype=dtype)
    # 16-token splits: 40 tokens take three (a three-split context with one split, the
    # last takes the rest).
    mla_decode_attention(out, query, cache, tables, lens, scale, LORA, num_splits=num_splits, split_tokens=16)
    expected = mla_decode_reference(query, cache, tables, lens, scale, LORA)
    dense = torch.stack([dense_mla(query[i], latent, scale) for i, latent in enumerate(latents)])
    torch.testing.assert_close(expected, dense, atol=1e-6, rtol=1e-6)  # the reference reads the right slots
    assert not out.isnan().any(), "an unwritten output, or a read of a poisoned slot"
    torch.testing.assert_close(out.float(), expected, **MLA_TOL[dtype])
    assert not out[-1].any(), "an empty context gives zeros"


@pytest.mark.timeout(60)
def test_mla_split_count_does_not_change_results() -> None:
    """Split boundaries are fixed in tokens: any split count that covers the longest
    context gives the same bits (an extra, empty split writes nothing)."""
    seq_lens = [3, 33, 48]
    cache, tables, _ = latent_cache(seq_lens, 16, torch.float32, seed=2)
    query = torch.randn(3, 4, LORA + ROPE)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    outs = []
    for splits in (3, 5):
        out = torch.empty(3, 4, LORA)
        mla_decode_attention(out, query, cache, tables, lens, 0.3, LORA, num_splits=splits, split_tokens=16)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.timeout(60)
def test_mla_launcher_names_bad_inputs() -> None:
    cache, tables, _ = latent_cache([5], 4, torch.float32)
    query, out = torch.randn(1, 4, LORA + ROPE), torch.empty(1, 4, LORA)
    lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_tables must be a contiguous 2-D torch.int32"):
        mla_decode_attention(out, query, cache, tables.long(), lens, 1.0, LORA)
    with pytest.raises(ValueError, match="seq_lens has 2 rows, expected 1"):
        mla_decode_attention(out, query, cache, tables, lens.repeat(2), 1.0, LORA)
    with pytest.raises(ValueError, match=r"kv_lora_rank must be in \[1, D\)"):
        mla_decode_attention(out, query, cache, tables, lens, 1.0, LORA + ROPE)
    with pytest.raises(ValueError, match="planes must alias"):  # a K/V cache is not a latent cache
        mla_decode_attention(out, query, torch.zeros(4, 2, 4, 1, LORA + ROPE), tables, lens, 1.0, LORA)
    with pytest.raises(ValueError, match=r"latent cache must be \[num_blocks, 2, block_size, 1, D\]"):
        mla_decode_attention(out, query, cache[..., :LORA].expand(-1, -1, -1, 2, -1), tables, lens, 1.0, LORA)
    with pytest.raises(ValueError, match="query is torch.bfloat16, the latent cache torch.float32"):
        mla_decode_attention(out, query.bfloat16(), cache, tables, lens, 1.0, LORA)
    with pytest.raises(ValueError, match=r"out must be \[batch, heads, 32\] = \[1, 4, 32\], got \(1, 4, 48\)"):
        mla_decode_attention(query.clone(), query, cache, tables, lens, 1.0, LORA)
    with pytest.raises(ValueError, match="query last dimension must be contiguous"):
        mla_decode_attention(out, query.transpose(0, 2).contiguous().transpose(0, 2), cache, tables, lens, 1.0, LORA)


def routed(tokens: int, num_experts: int, dtype: torch.dtype, seed: int):
    """x, top-2 experts and weights with a skewed router: expert 5 is nearly everyone's
    pick (a run over several 16-slot tiles at 33 tokens), expert 2 nobody's."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, num_experts, generator=g)
    scores[:, 5] += 2.0
    scores[:, 2] -= 100.0
    weights, experts = scores.softmax(-1).topk(2, dim=-1)
    x = torch.randn(tokens, 64, generator=g).to(dtype)
    return x, experts, (weights / weights.sum(-1, keepdim=True)).to(dtype)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("first,local", [(0, 8), (4, 4)])  # all experts; an expert-parallel half
def test_fused_moe_matches_experts_forward(dtype: torch.dtype, tokens: int, first: int, local: int) -> None:
    hidden, inter = 64, 32
    x, experts, weights = routed(tokens, 8, dtype, seed=tokens)
    g = torch.Generator().manual_seed(100 + tokens)
    w13 = (torch.randn(local, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(local, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    out = fused_moe(x, w13, w2, experts, weights, first)
    expected = fused_moe_reference(x, w13, w2, experts, weights, first)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, **MOE_TOL[dtype])
    mine = ((experts >= first) & (experts < first + local)).any(-1)
    assert not out[~mine].any(), "a token routed only to other ranks' experts gets nothing"
    assert out[mine].abs().sum(-1).min() > 0


@pytest.mark.timeout(60)
def test_align_by_expert_pads_each_run() -> None:
    # Slots 0..5 of 3 tokens (top-2); experts 1..4 are local (first=1, E=4).
    experts = torch.tensor([[3, 1], [1, 0], [5, 3]])
    sorted_slots, tile_experts = align_by_expert(experts, 4, 1, 16)
    assert sorted_slots.dtype == tile_experts.dtype == torch.int32
    # Worst case tiles: ceil(6 / 16) + min(4 experts, 6 slots).
    assert sorted_slots.shape == (5 * 16,) and tile_experts.tolist() == [0, 2, -1, -1, -1]
    assert sorted_slots[:2].tolist() == [1, 2] and sorted_slots[16:18].tolist() == [0, 5]
    runs = torch.cat([sorted_slots[2:16], sorted_slots[18:]])
    assert (runs == 6).all(), "padding rows hold the sentinel T * k"
    assert fused_moe(torch.randn(0, 64), torch.randn(2, 64, 64), torch.randn(2, 64, 32),
                     torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2)).shape == (0, 64)


@pytest.mark.timeout(60)
def test_fused_moe_names_bad_inputs() -> None:
    x, experts, weights = routed(3, 8, torch.float32, seed=0)
    w13, w2 = torch.randn(8, 64, 64), torch.randn(8, 64, 32)
    with pytest.raises(ValueError, match=r"experts must be \[3, top_k\] int64, got \(3, 2\) torch.int32"):
        fused_moe(x, w13, w2, experts.int(), weights)
    with pytest.raises(ValueError, match=r"w2 must be \[8, 64, 32\] to match w13"):
        fused_moe(x, w13, torch.randn(8, 32, 64), experts, weights)
    with pytest.raises(ValueError, match=r"w13 must be \[experts, 2 \* intermediate, 64\]"):
        fused_moe(x, torch.randn(8, 63, 64), w2, experts, weights)
    with pytest.raises(ValueError, match="w13 is torch.bfloat16 on cpu, x torch.float32"):
        fused_moe(x, w13.bfloat16(), w2, experts, weights)
    with pytest.raises(ValueError, match=r"weights must be a float \[3, top_k\] like experts"):
        fused_moe(x, w13, w2, experts, weights[:, :1])
    with pytest.raises(ValueError, match=r"x must be \[tokens, hidden\] with contiguous rows"):
        fused_moe(x[None], w13, w2, experts, weights)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16, got 24"):
        MoEConfig(block_k=24)
