"""Paged attention backends against dense causal attention on contiguous K/V.

Blocks are scattered at random in the pool, contexts end on and just past block
boundaries, GQA ratios vary, and some sequences have a cached prefix.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import backend as backends
from engine.attention import reference
from engine.attention.metadata import AttentionMetadata
from engine.attention.reference import store_kv
from engine.kv_cache.layout import cache_shape, layer_view


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q: [n, Hq, D] for the last n positions of k/v: [L, H, D]; plain softmax, no SDPA;
    window > 0: each query sees its last `window` positions (transformers' sliding window);
    softcap > 0: scores capped to softcap * tanh(score / softcap) (Gemma 2)."""
    n, hq, _ = q.shape
    L, h, _ = k.shape
    k = k.repeat_interleave(hq // h, dim=1)
    v = v.repeat_interleave(hq // h, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(L - n, L)[:, None]
    keys = torch.arange(L)[None, :]
    scores = scores.masked_fill((keys > pos) | ((keys <= pos - window) if window else False), float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend", ["reference", "torch", "torch-blocked", "triton"])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("case", [
    [(1, 1), (1, 16), (1, 17), (1, 40)],          # pure decode, contexts on/past boundaries
    [(16, 16), (5, 37), (1, 9), (33, 33)],        # mixed: full prefill, chunk over prefix, decode
    [(1, 64), (7, 7), (1, 3)],                    # decodes around a prefill
    [(4, 40), (6, 17), (1, 9), (18, 50), (17, 30)],  # chunks over a cached prefix
    "verify",  # speculative verify rows (a decode row per token), beside prompts and decodes
])
# Sliding windows: none, within a block, one block wide (edges on block boundaries);
# then scores soft-capped (a cap small enough to change them), with a window.
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (7, 0.0), (16, 0.0), (7, 2.0)])
def test_paged_matches_dense(backend: str, gqa: int, case: list[tuple[int, int]] | str, window: int,
                             softcap: float, monkeypatch: pytest.MonkeyPatch) -> None:
    num_drafts = None
    if case == "verify":  # each sequence's last token and its drafts; then a prompt, a chunk and a decode
        case, num_drafts = [(4, 40), (6, 17), (17, 30), (7, 7), (5, 37), (1, 9)], [3, 5, 16, 0, 0, 0]
    if backend == "torch-blocked":  # the plain-torch decode path, as without a C compiler
        monkeypatch.setattr(backends.cpu_decode, "supports", lambda *args: False)
        backend = "torch"
    torch.manual_seed(0)
    block_size, h, d, num_blocks = 16, 2, 32, 40
    # Layer 1 of a 3-layer cache in the engine's layout (a strided view, as the backends
    # get it); poisoned: unwritten reads fail.
    cache = layer_view(torch.full(cache_shape(num_blocks, h, 3, block_size, d), float("nan")), 1)
    perm = torch.randperm(num_blocks).tolist()
    tables, slots, qs, ks, vs, refs = [], [], [], [], [], []
    for q_len, seq_len in case:
        n_blocks = -(-seq_len // block_size)
        table = [perm.pop() for _ in range(n_blocks)]
        tables.append(table + [0] * (4 - n_blocks))
        k, v = torch.randn(seq_len, h, d), torch.randn(seq_len, h, d)
        q = torch.randn(q_len, h * gqa, d)
        pos = torch.arange(seq_len)
        all_slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        # Cached prefix written before the step; the new tokens' K/V are stored by the test below.
        prefix = seq_len - q_len
        store_kv(cache, k[:prefix], v[:prefix], all_slots[:prefix])
        # Blocks wholly before the step's first window may be freed and reused: poison
        # them, so any read of one fails.
        if window:
            cache[table[:reference.window_start(prefix, window) // block_size]] = float("nan")
        slots.append(all_slots[prefix:])
        qs.append(q), ks.append(k[prefix:]), vs.append(v[prefix:])
        refs.append(dense_attention(q, k, v, d ** -0.5, window, softcap))
    md = AttentionMetadata(
        slot_mapping=torch.cat(slots + [torch.tensor([-1])]),  # one padding slot
        query_start_loc=torch.tensor([0] + torch.cumsum(torch.tensor([q for q, _ in case]), 0).tolist(),
                                     dtype=torch.int32),
        seq_lens=torch.tensor([s for _, s in case], dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_cpu=[q for q, _ in case],
        seq_lens_cpu=[s for _, s in case],
        num_drafts_cpu=num_drafts,
    )
    pad = torch.zeros(1, h, d)
    impl = backends.get_backend(backend, "cpu")
    impl.prepare(md, block_size)
    impl.store_kv(cache, torch.cat(ks + [pad]), torch.cat(vs + [pad]), md)
    out = impl.attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, md, d ** -0.5, window, softcap)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=1e-5)


def test_store_skips_padding_slots() -> None:
    cache = torch.zeros(2, 2, 4, 1, 2)
    store_kv(cache, torch.ones(3, 1, 2), torch.ones(3, 1, 2) * 2, torch.tensor([0, -1, 5]))
    assert cache[0, 0, 0].sum() == 2 and cache[1, 1, 1].sum() == 4
    assert cache.sum() == 12  # K (ones) and V (twos) of slots 0 and 5, nothing else
