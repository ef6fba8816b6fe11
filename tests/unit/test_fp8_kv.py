"""An fp8 KV cache (engine/attention/kv_quant.py) through every attention path.

The rounding is the model's; the backends only store and widen. So each path run on
an fp8 cache must equal the same path run on that cache widened to float32, bit for
bit (the C kernel, the blocked torch path, the reference), or within the kernels'
float32 tolerance (Triton, under the interpreter). The caches are NaN-poisoned, so a
read of an unwritten slot fails.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import cpu_decode, reference
from engine.attention.blocked import blocked_decode_attention, build_decode_plan
from engine.attention.kv_quant import cache_dtype, fp8_table, is_fp8, readable, round_to_cache
from engine.kernels.decode_attention import decode_attention
from engine.kernels.prefill_attention import plan_tiles, prefill_attention
from engine.kernels.store_kv import store_kv
from engine.kv_cache.layout import cache_shape, layer_view
from engine.native import compiler

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def test_cache_dtype_names() -> None:
    assert cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert cache_dtype("fp8", torch.float32) == cache_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert cache_dtype("fp8_e5m2", torch.float16) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        cache_dtype("int8", torch.float32)
    assert is_fp8(torch.float8_e5m2) and not is_fp8(torch.bfloat16)


@pytest.mark.parametrize("dtype", FP8)
def test_round_to_cache_saturates_and_is_exact_to_store(dtype: torch.dtype) -> None:
    limit = torch.finfo(dtype).max
    x = torch.tensor([0.0, 1.0, -3.3, 1e6, -1e6, 1e-12, float("nan")])
    y = round_to_cache(x, 1.0, dtype)
    assert y.dtype == torch.float32
    assert y[3] == limit and y[4] == -limit, "overflow must saturate, never become inf"
    assert torch.isnan(y[6])
    # On the grid: storing and widening again changes nothing.
    torch.testing.assert_close(y.to(dtype).float(), y, equal_nan=True, atol=0, rtol=0)
    # A scale divides before rounding.
    assert round_to_cache(torch.tensor([8.0]), 2.0, dtype).item() == 4.0


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_table_is_every_byte(dtype: torch.dtype) -> None:
    table = fp8_table(dtype)
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    torch.testing.assert_close(table, raw.view(dtype).float(), equal_nan=True, atol=0, rtol=0)


def scattered(dtype: torch.dtype, seq_lens: list[int], block_size: int = 16, kv_heads: int = 2,
              head_dim: int = 64, seed: int = 0):
    """An fp8 cache (layer 1 of 3 of the engine's layout, NaN-poisoned) with each
    sequence's K/V, already on the grid, in random blocks; and its float32 twin."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    cache = torch.full(cache_shape(num_blocks, kv_heads, 3, block_size, head_dim), float("nan")).to(dtype)
    view = layer_view(cache, 1)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros((len(seq_lens), max(per_seq) + 1), dtype=torch.int32)
    for i, (n, nb) in enumerate(zip(seq_lens, per_seq)):
        k = round_to_cache(torch.randn(n, kv_heads, head_dim, generator=g) * 3, 1.0, dtype)
        v = round_to_cache(torch.randn(n, kv_heads, head_dim, generator=g), 1.0, dtype)
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        pos = torch.arange(n)
        reference.store_kv(view, k, v, tables[i].long()[pos // block_size] * block_size + pos % block_size)
    return view, layer_view(cache.float(), 1), tables


@pytest.mark.parametrize("dtype", FP8)
def test_reference_store_and_gather_round_trip(dtype: torch.dtype) -> None:
    view, wide, tables = scattered(dtype, [40])
    k, v = reference.gather_kv(view, tables[0], 40, torch.float32)
    k32, v32 = reference.gather_kv(wide, tables[0], 40)
    assert k.dtype == torch.float32
    torch.testing.assert_close((k, v), (k32, v32), atol=0, rtol=0)
    assert readable(view, torch.float16).dtype == torch.float16 and readable(wide, torch.float16) is wide


@pytest.mark.skipif(compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("groups", [1, 4])
def test_c_kernel_on_fp8_equals_it_on_the_widened_cache(dtype: torch.dtype, groups: int) -> None:
    seq_lens = [1, 16, 17, 70]
    view, wide, tables = scattered(dtype, seq_lens)
    assert cpu_decode.supports(view, 2 * groups)
    query = torch.randn(len(seq_lens), 2 * groups, 64)
    rows, lens = torch.arange(len(seq_lens)), torch.tensor(seq_lens, dtype=torch.int32)
    out = cpu_decode.paged_decode_attention(query, view, rows, tables, lens, 0.125)
    expected = cpu_decode.paged_decode_attention(query, wide, rows, tables, lens, 0.125)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", FP8)
def test_blocked_path_on_fp8_equals_it_on_the_widened_cache(dtype: torch.dtype) -> None:
    seq_lens = [3, 33, 64]
    view, wide, tables = scattered(dtype, seq_lens)
    query = torch.randn(len(seq_lens), 4, 64)
    outs = []
    for cache in (view, wide):
        plan = build_decode_plan(list(range(len(seq_lens))), tables, seq_lens, 16)
        outs.append(blocked_decode_attention(query, cache, plan, 0.125))
    assert not outs[0].isnan().any()
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


TRITON_TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", FP8)
def test_triton_store_kv_writes_the_grid_values(dtype: torch.dtype) -> None:
    cache = torch.full(cache_shape(4, 2, 3, 16, 32), float("nan")).to(dtype)
    expected = cache.clone()
    key = round_to_cache(torch.randn(3, 2, 32) * 4, 1.0, dtype)
    value = round_to_cache(torch.randn(3, 2, 32), 1.0, dtype)
    slots = torch.tensor([0, -1, 63])
    store_kv(layer_view(cache, 1), key, value, slots)
    reference.store_kv(layer_view(expected, 1), key, value, slots)
    torch.testing.assert_close(cache.float(), expected.float(), equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", FP8)
def test_triton_decode_and_prefill_read_fp8(dtype: torch.dtype) -> None:
    seq_lens = [17, 40]
    view, wide, tables = scattered(dtype, seq_lens, head_dim=32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(2, 4, 32)
    rows = torch.arange(2, dtype=torch.int32)
    out, expected = torch.full_like(query, float("nan")), torch.full_like(query, float("nan"))
    decode_attention(out, query, view, rows, tables, lens, 0.2)
    decode_attention(expected, query, wide, rows, tables, lens, 0.2)
    torch.testing.assert_close(out, expected, **TRITON_TOL)
    # Prompt chunks of 5 and 9 tokens over the cached context.
    q_lens = [5, 9]
    query = torch.randn(sum(q_lens), 4, 32)
    starts = torch.tensor([0, 5, 14], dtype=torch.int32)
    tile_seq, tile_start = plan_tiles(q_lens, [0, 1], 16)
    out, expected = torch.full_like(query, float("nan")), torch.full_like(query, float("nan"))
    for cache, result in ((view, out), (wide, expected)):
        prefill_attention(result, query, cache, tables, lens, starts, torch.from_numpy(tile_seq),
                          torch.from_numpy(tile_start), 0.2)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, **TRITON_TOL)


@pytest.mark.skipif(compiler() is None, reason="no C compiler")
def test_c_kernel_takes_bf16_rows_over_an_fp8_cache() -> None:
    """Widened to float32 in, narrowed out: the float32 rows' result, rounded once."""
    view, _, tables = scattered(torch.float8_e4m3fn, [5, 33])
    query = torch.randn(4, 4, 64).to(torch.bfloat16)
    rows, lens = torch.tensor([3, 1]), torch.tensor([5, 33], dtype=torch.int32)
    assert cpu_decode.supports(view, 4, torch.bfloat16) and not cpu_decode.supports(view, 4, torch.float64)
    out = cpu_decode.paged_decode_attention(query, view, rows, tables, lens, 0.125)
    expected = cpu_decode.paged_decode_attention(query.float(), view, rows, tables, lens, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.to(torch.bfloat16), atol=0, rtol=0)
