"""The C decode-attention kernel against dense attention, and its input checks."""

from __future__ import annotations

import pytest
import torch

from engine.attention import cpu_decode
from engine.kv_cache.layout import cache_shape, layer_view
from engine.native import compiler

# With a compiler the C file must build: a build error fails these tests, never skips them.
pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler")


def dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [Hq, D], the last position's query; k, v: [L, H, D]."""
    groups = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    p = (torch.einsum("hd,lhd->hl", q, k) * scale).softmax(-1)
    return torch.einsum("hl,lhd->hd", p, v)


def build(seq_lens: list[int], block_size: int, kv_heads: int, groups: int, head_dim: int,
          num_layers: int = 3, layer: int = 1, heads_inner: bool = False):
    """A NaN-poisoned cache in the engine's layout with each sequence's K/V scattered
    over random blocks of `layer`; returns the layer view, the block tables and the
    dense K/V. heads_inner: a [blocks, layers, 2, bs, H, D] cache instead (head stride
    head_dim), since the kernel takes any strides with contiguous head dims."""
    torch.manual_seed(sum(seq_lens) + head_dim)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    if heads_inner:
        cache = torch.full((num_blocks, num_layers, 2, block_size, kv_heads, head_dim), float("nan"))
        layer_cache = cache[:, layer]
    else:
        cache = torch.full(cache_shape(num_blocks, kv_heads, num_layers, block_size, head_dim), float("nan"))
        layer_cache = layer_view(cache, layer)
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.zeros((len(seq_lens), max(per_seq) + 2), dtype=torch.int32)  # padded rows
    dense = []
    for i, (n, nb) in enumerate(zip(seq_lens, per_seq)):
        k, v = torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim)
        blocks = [perm.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(blocks)
        for j, b in enumerate(blocks):
            chunk = slice(j * block_size, min(n, (j + 1) * block_size))
            m = chunk.stop - chunk.start
            layer_cache[b, 0, :m], layer_cache[b, 1, :m] = k[chunk], v[chunk]
        dense.append((k, v))
    return layer_cache, tables, dense


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads,groups", [(2, 1), (2, 4), (1, 8)])
@pytest.mark.parametrize("seq_lens", [
    [1, 16, 17, 32, 33, 200],  # on and just past block boundaries, very different lengths
    [95],                      # one row: heads split across threads
])
@pytest.mark.parametrize("heads_inner", [False, True], ids=["engine_layout", "heads_inner"])
def test_matches_dense(block_size: int, head_dim: int, kv_heads: int, groups: int,
                       seq_lens: list[int], heads_inner: bool) -> None:
    layer_cache, tables, dense = build(seq_lens, block_size, kv_heads, groups, head_dim,
                                       heads_inner=heads_inner)
    num_rows = len(seq_lens)
    # Decode rows sit among other tokens of the flattened batch (e.g. a prefill chunk).
    rows = torch.arange(num_rows, dtype=torch.int64) * 3 + 1
    query = torch.randn(3 * num_rows + 2, kv_heads * groups, head_dim)
    scale = head_dim ** -0.5
    out = cpu_decode.paged_decode_attention(query, layer_cache, rows, tables,
                                            torch.tensor(seq_lens, dtype=torch.int32), scale)
    assert not torch.isnan(out).any()
    expected = torch.stack([dense_decode(query[r], k, v, scale) for r, (k, v) in zip(rows, dense)])
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_query_with_strided_rows() -> None:
    """q sliced out of a fused qkv projection: rows are not contiguous with each other."""
    layer_cache, tables, dense = build([5, 40], 16, 2, 2, 64)
    qkv = torch.randn(2, 4 * 64 + 2 * 2 * 64)
    query = qkv[:, :4 * 64].view(2, 4, 64)
    out = cpu_decode.paged_decode_attention(query, layer_cache, torch.arange(2), tables,
                                            torch.tensor([5, 40], dtype=torch.int32), 0.125)
    expected = torch.stack([dense_decode(query[i], k, v, 0.125) for i, (k, v) in enumerate(dense)])
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_rejects_bad_inputs() -> None:
    layer_cache, tables, _ = build([5], 16, 2, 2, 64)
    query, rows, lens = torch.randn(1, 4, 64), torch.zeros(1, dtype=torch.int64), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="unsupported cache"):
        cpu_decode.paged_decode_attention(query, layer_cache.half(), rows, tables, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables must be a contiguous torch.int32"):
        cpu_decode.paged_decode_attention(query, layer_cache, rows, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="does not match layer cache"):
        cpu_decode.paged_decode_attention(torch.randn(1, 4, 32), layer_cache, rows, tables, lens, 1.0)
    with pytest.raises(ValueError, match="query must be float32"):
        cpu_decode.paged_decode_attention(query.double(), layer_cache, rows, tables, lens, 1.0)
    assert not cpu_decode.supports(layer_cache.bfloat16(), 4)
    assert cpu_decode.supports(layer_cache, 4)
    assert not cpu_decode.supports(layer_cache[..., ::2], 4), "a head's dims must be contiguous"
