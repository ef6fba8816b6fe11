"""The Triton kernels against the torch reference, under TRITON_INTERPRET=1 on CPU.

Blocks are scattered at random over a NaN-poisoned pool, contexts end on and just
past block boundaries, GQA ratios are 1, 4 and 8, and the outputs are poisoned too,
so any unwritten element or any read of an unwritten slot fails. Shapes stay small:
the interpreter costs about a millisecond per program.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import reference
from engine.kernels import decode_attention as decode_mod
from engine.kernels import prefill_attention as prefill_mod
from engine.kernels.common import LaunchConfig
from engine.kernels.decode_attention import decode_attention, num_splits_for, split_programs_for
from engine.kernels.prefill_attention import plan_tiles, prefill_attention
from engine.kernels.store_kv import store_kv
from engine.kv_cache.layout import cache_shape, layer_view

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
          softcap: float = 0.0) -> torch.Tensor:
    """q [n, Hq, D] for the last n of L positions; k, v [L, H, D]; fp32 softmax; window
    > 0: each query sees its last `window` positions; softcap > 0: scores soft-capped."""
    n, hq, _ = q.shape
    L, h, _ = k.shape
    q, k, v = q.float(), k.float().repeat_interleave(hq // h, 1), v.float().repeat_interleave(hq // h, 1)
    s = torch.einsum("nhd,lhd->hnl", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    keys, pos = torch.arange(L)[None, :], torch.arange(L - n, L)[:, None]
    s = s.masked_fill((keys > pos) | ((keys <= pos - window) if window else False), float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def poisoned_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """A NaN-filled 3-layer cache in the engine's layout."""
    return torch.full(cache_shape(num_blocks, kv_heads, 3, block_size, head_dim), float("nan"), dtype=dtype)


def scattered_cache(seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int,
                    dtype: torch.dtype, seed: int = 0):
    """A poisoned [blocks, 2, bs, H, D] layer view holding each sequence's K/V in random blocks."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    # Layer 1's strided view, as the kernels get it: the head stride is not head_dim.
    cache = layer_view(poisoned_cache(sum(per_seq) + 2, block_size, kv_heads, head_dim, dtype), 1)
    perm = torch.randperm(cache.shape[0], generator=g).tolist()
    tables = torch.zeros((len(seq_lens), max(per_seq) + 1), dtype=torch.int32)
    kvs = []
    for i, (n, nb) in enumerate(zip(seq_lens, per_seq)):
        k = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        pos = torch.arange(n)
        reference.store_kv(cache, k, v, tables[i].long()[pos // block_size] * block_size + pos % block_size)
        kvs.append((k, v))
    return cache, tables, kvs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_matches_reference(dtype: torch.dtype) -> None:
    cache = poisoned_cache(6, 16, 3, 32, dtype)  # 3 heads: padded to 4 in the kernel
    expected = cache.clone()
    key, value = torch.randn(5, 3, 32).to(dtype), torch.randn(5, 3, 32).to(dtype)
    slots = torch.tensor([0, 17, -1, 95, 40])  # first slot, mid-block, padding, last slot of the pool
    store_kv(layer_view(cache, 1), key, value, slots)
    reference.store_kv(layer_view(expected, 1), key, value, slots)
    # The whole cache: nothing lands in another layer's slots either.
    torch.testing.assert_close(cache, expected, equal_nan=True, atol=0, rtol=0)
    assert not cache[:, :, 1].isnan().all(), "the store wrote nothing"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 32)])
@pytest.mark.parametrize("kv_heads,groups", [(2, 1), (1, 4), (1, 8)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("config", [decode_mod.CPU_CONFIG, decode_mod.GPU_CONFIG], ids=["cpu", "gpu"])
def test_decode_matches_dense(dtype: torch.dtype, block_size: int, head_dim: int, kv_heads: int,
                              groups: int, num_splits: int, config: LaunchConfig) -> None:
    seq_lens = [1, 16, 17, 32, 33, 70]
    cache, tables, kvs = scattered_cache(seq_lens, block_size, kv_heads, head_dim, dtype)
    num_tokens = len(seq_lens) * 2 + 1
    query = torch.randn(num_tokens, kv_heads * groups, head_dim).to(dtype)
    rows = torch.arange(len(seq_lens), dtype=torch.int32) * 2 + 1  # decode rows among other tokens
    out = torch.full_like(query, float("nan"))
    scale = head_dim ** -0.5
    decode_attention(out, query, cache, rows, tables, torch.tensor(seq_lens, dtype=torch.int32),
                     scale, num_splits, split_tokens=max(32, config.block_n), config=config)
    expected = torch.cat([dense(query[r:r + 1], k, v, scale) for r, (k, v) in zip(rows.tolist(), kvs)])
    torch.testing.assert_close(out[rows.long()].float(), expected, **TOL[dtype])
    others = torch.ones(num_tokens, dtype=torch.bool)
    others[rows.long()] = False
    assert out[others].isnan().all(), "rows that are not decode rows must stay untouched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("config", [prefill_mod.CPU_CONFIG, prefill_mod.GPU_CONFIG], ids=["cpu", "gpu"])
def test_prefill_matches_dense(dtype: torch.dtype, block_size: int, groups: int, config: LaunchConfig) -> None:
    # (new tokens, context + new): fresh prompts, a chunk after a multi-block cached
    # prefix, a prompt past one query tile, and a decode row the kernel must skip.
    case = [(20, 20), (7, 55), (40, 40), (1, 9), (33, 65)]
    kv_heads, head_dim = 2, 32
    cache, tables, kvs = scattered_cache([s for _, s in case], block_size, kv_heads, head_dim, dtype)
    q_lens = [q for q, _ in case]
    query = torch.randn(sum(q_lens), kv_heads * groups, head_dim).to(dtype)
    out = torch.full_like(query, float("nan"))
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    prefill = [i for i, q in enumerate(q_lens) if q > 1]
    tile_seq, tile_start = plan_tiles(q_lens, prefill, config.block_m)
    scale = head_dim ** -0.5
    prefill_attention(out, query, cache, tables, torch.tensor([s for _, s in case], dtype=torch.int32),
                      starts, torch.from_numpy(tile_seq), torch.from_numpy(tile_start), scale, config)
    for i, (k, v) in enumerate(kvs):
        rows = slice(starts[i].item(), starts[i + 1].item())
        if i in prefill:
            torch.testing.assert_close(out[rows].float(), dense(query[rows], k, v, scale), **TOL[dtype])
        else:
            assert out[rows].isnan().all()


@pytest.mark.parametrize("config_name", ["cpu", "gpu"])
@pytest.mark.parametrize("window,softcap", [(5, 0.0), (40, 2.0)])
def test_sliding_window_never_reads_blocks_before_it(config_name: str, window: int, softcap: float) -> None:
    """Both kernels with a window, past and within one key tile, split-KV included;
    blocks wholly before each sequence's first window are NaN (freed, reused). Then
    with scores soft-capped too (Gemma 2's local layers)."""
    block_size = 16
    case = [(20, 20), (7, 90), (40, 40), (1, 9), (1, 130), (33, 65)]  # (new tokens, context + new)
    cache, tables, kvs = scattered_cache([s for _, s in case], block_size, 2, 32, torch.float32)
    for (q_len, seq_len), table in zip(case, tables):
        first = max(0, seq_len - q_len - window + 1) // block_size
        cache[table[:first].long()] = float("nan")
    q_lens = [q for q, _ in case]
    query = torch.randn(sum(q_lens), 4, 32)
    out = torch.full_like(query, float("nan"))
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in case], dtype=torch.int32)
    prefill = [i for i, q in enumerate(q_lens) if q > 1]
    decode = [i for i, q in enumerate(q_lens) if q == 1]
    prefill_config = {"cpu": prefill_mod.CPU_CONFIG, "gpu": prefill_mod.GPU_CONFIG}[config_name]
    decode_config = {"cpu": decode_mod.CPU_CONFIG, "gpu": decode_mod.GPU_CONFIG}[config_name]
    tile_seq, tile_start = plan_tiles(q_lens, prefill, prefill_config.block_m)
    prefill_attention(out, query, cache, tables, seq_lens, starts, torch.from_numpy(tile_seq),
                      torch.from_numpy(tile_start), 0.2, prefill_config, window=window, softcap=softcap)
    split = max(32, decode_config.block_n)
    decode_attention(out, query, cache, starts[decode], tables[decode], seq_lens[decode], 0.2,
                     num_splits_for(130, split), split_tokens=split, config=decode_config, window=window,
                     softcap=softcap)
    for i, (k, v) in enumerate(kvs):
        rows = slice(starts[i].item(), starts[i + 1].item())
        torch.testing.assert_close(out[rows], dense(query[rows], k, v, 0.2, window, softcap), **TOL[torch.float32])


def test_launchers_name_bad_inputs() -> None:
    cache, tables, _ = scattered_cache([5], 16, 2, 32, torch.float32)
    query, out = torch.randn(1, 4, 32), torch.empty(1, 4, 32)
    rows, lens = torch.zeros(1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_tables must be a contiguous 2-D torch.int32"):
        decode_attention(out, query, cache, rows, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="multiple of the cache's 2 KV heads"):
        decode_attention(out, torch.randn(1, 3, 32), cache, rows, tables, lens, 1.0)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        decode_attention(out, query, torch.zeros(4, 2, 16, 2, 24), rows, tables, lens, 1.0)
    with pytest.raises(ValueError, match="key is torch.float16, the KV cache torch.float32"):
        store_kv(cache, torch.zeros(1, 2, 32, dtype=torch.float16), torch.zeros(1, 2, 32), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping has 2 rows, expected 1"):
        store_kv(cache, torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="multiple of the 64-token tile"):
        decode_attention(out, query, cache, rows, tables, lens, 1.0, 2, split_tokens=32,
                         config=LaunchConfig(block_n=64))
    for programs, splits in ((3, 2), (0, 2), (2, 1)):
        with pytest.raises(ValueError, match=rf"split_programs must be in \[1, num_splits={splits}\], "
                                             rf"got {programs}"):
            decode_attention(out, query, cache, rows, tables, lens, 1.0, splits, split_tokens=32,
                             split_programs=programs)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 24"):
        LaunchConfig(block_n=24)
    with pytest.raises(ValueError, match="num_warps=3"):
        LaunchConfig(block_n=32, num_warps=3)


def test_split_count_does_not_change_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager steps and CUDA graphs launch different split counts for the same rows, and
    at large batches fewer programs than splits, each looping over several."""
    seq_lens = [5, 32, 40, 96]
    cache, tables, _ = scattered_cache(seq_lens, 16, 2, 32, torch.float32)
    query = torch.randn(4, 4, 32)
    rows, lens = torch.arange(4, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    # Splits past a context write no partials: poison the partial buffers, so reading
    # one of those would show.
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).fill_(float("nan")))
    outs = []
    for splits, programs in ((num_splits_for(max(seq_lens), 32), None), (6, None), (6, 2), (6, 1), (3, 1)):
        out = torch.empty_like(query)
        decode_attention(out, query, cache, rows, tables, lens, 0.2, splits, split_tokens=32,
                         split_programs=programs)
        outs.append(out)
    monkeypatch.undo()
    assert not outs[0].isnan().any()
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    single = torch.empty_like(query[:2])  # contexts within one split: the unsplit path
    decode_attention(single, query[:2], cache, rows[:2], tables[:2], lens[:2], 0.2, 1, split_tokens=32)
    assert torch.equal(single, outs[0][:2])
    # Two 32-token tiles per split (and an empty third split); too few splits for 96
    # tokens (the last one takes the rest). Any program count gives the same result.
    for split_tokens, splits in ((64, 3), (32, 2)):
        looped = [torch.empty_like(query) for _ in range(splits)]
        for programs, out in enumerate(looped, 1):
            decode_attention(out, query, cache, rows, tables, lens, 0.2, splits, split_tokens=split_tokens,
                             split_programs=programs)
        assert all(torch.equal(out, looped[0]) for out in looped[1:])
    assert num_splits_for(96, 32) == 3 and num_splits_for(97, 32) == 4 and num_splits_for(1) == 1
    # One program per split up to 16 per SM (132 SMs, as on an H200), fewer past that.
    cpu = torch.device("cpu")
    assert [split_programs_for(b, 8, n, cpu) for b, n in ((64, 4), (1, 16), (256, 2), (256, 16))] == [4, 16, 2, 2]
