"""Row 2 of the GPU check: decode-attention bandwidth against HBM's, the graphed
split layouts, and the prefill kernel's rate; decode_bandwidth and prefill_rate also
time the tile sweep's candidates."""

from __future__ import annotations

from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import HBM_BYTES_PER_S, Setup
from benchmarks.gpu.timing import kernel_seconds


def check_bandwidth(s: Setup) -> None:
    for head_dim in (64, 128):
        seconds, nbytes = decode_bandwidth(s, head_dim)
        pct = 100 * nbytes / seconds / HBM_BYTES_PER_S
        row(f"decode kernel bandwidth b{s.bw_batch} ctx{s.bw_context} d{head_dim}",
            f"{nbytes / seconds / 1e12:.2f} TB/s ({pct:.0f}%, {seconds * 1e6:.0f} us)", ">= 80%", pct >= 80)  # issue 19, P3
    b, ctx = max(s.step_batches), s.step_context
    seconds, nbytes = decode_bandwidth(s, s.hidden // s.heads, batch=b, context=ctx)
    row(f"decode kernel b{b} ctx{ctx} d{s.hidden // s.heads} (the model's)",
        f"{seconds * 1e6:.0f} us x {s.layers} layers = {seconds * s.layers * 1e3:.2f} ms, "
        f"{100 * nbytes / seconds / HBM_BYTES_PER_S:.0f}%", "(info)")
    # A CUDA graph launches the splits of the longest context it serves (engine/cuda_graphs.py):
    # 16 for ~1k contexts here. Timed with the launcher's programs per (sequence, KV head),
    # which loop over the splits at this batch, and with one program per split.
    import torch

    from engine.cuda_graphs import MAX_CONTEXT
    from engine.kernels.decode_attention import num_splits_for, split_programs_for

    graph_splits = num_splits_for(MAX_CONTEXT)
    programs = split_programs_for(b, s.kv_heads, graph_splits, torch.device(s.device))
    # The engine rows' context (~1k, 3 splits used), and the longest a graph serves (on
    # CPU, under the interpreter's ~1 s per 16-split call, the first only).
    for context in (ctx + 20, MAX_CONTEXT) if s.device != "cpu" else (ctx + 20,):
        eager, _ = decode_bandwidth(s, s.hidden // s.heads, batch=b, context=context)
        looped, _ = decode_bandwidth(s, s.hidden // s.heads, batch=b, context=context, splits=graph_splits)
        one_each, _ = decode_bandwidth(s, s.hidden // s.heads, batch=b, context=context, splits=graph_splits,
                                       programs=graph_splits)
        row(f"decode kernel b{b} ctx{context}, {graph_splits} splits (as graphed): {programs} / {graph_splits} "
            "programs per sequence and KV head", f"{looped * 1e6:.0f} / {one_each * 1e6:.0f} us "
            f"({looped / eager:.2f}x / {one_each / eager:.2f}x eager's {num_splits_for(context)} splits)", "(info)")
    seqs, q_len = s.bw_prefill
    rate = prefill_rate(s, seqs=seqs, q_len=q_len)
    row(f"prefill kernel, {seqs} x {q_len} causal, d64", f"{rate:.0f} TFLOP/s", "(info)")


def engine_layer(num_blocks: int, kv_heads: int, block_size: int, head_dim: int, dtype, device: str):
    """A random one-layer cache in the engine's layout, as the kernels see a layer of it
    ([blocks, 2, bs, H, D] with the engine's strides); its numel is every byte it holds."""
    import torch

    from engine.kv_cache.layout import cache_shape, layer_view

    return layer_view(torch.randn(cache_shape(num_blocks, kv_heads, 1, block_size, head_dim),
                                  device=device).to(dtype), 0)


def decode_bandwidth(s: Setup, head_dim: int, config=None, batch: int | None = None,
                     context: int | None = None, splits: int | None = None,
                     programs: int | None = None, cache_dtype=None) -> tuple[float, float]:
    """(seconds, bytes) of one decode_attention call (default: batch bw_batch, context
    bw_context, the splits an eager step uses for that context, the launcher's programs
    per (sequence, KV head), a cache of the setup's dtype)."""
    import torch

    from engine.kernels.decode_attention import decode_attention, num_splits_for

    dtype = getattr(torch, s.dtype)
    b, ctx, bs = batch or s.bw_batch, context or s.bw_context, 16
    per_seq = -(-ctx // bs)
    cache = engine_layer(b * per_seq, s.kv_heads, bs, head_dim, cache_dtype or dtype, s.device)
    tables = torch.randperm(b * per_seq, device=s.device).to(torch.int32).view(b, per_seq)
    query = torch.randn(b, s.heads, head_dim, device=s.device).to(dtype)
    out = torch.empty_like(query)
    rows = torch.arange(b, dtype=torch.int32, device=s.device)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=s.device)
    splits = splits or num_splits_for(ctx)
    seconds = kernel_seconds(lambda: decode_attention(out, query, cache, rows, tables, lens, 0.1, splits,
                                                      config=config, split_programs=programs), s.device)
    return seconds, cache.numel() * cache.element_size() + 2 * query.numel() * query.element_size()


def prefill_rate(s: Setup, config=None, seqs: int = 16, q_len: int = 512) -> float:
    """TFLOP/s of prefill_attention over `seqs` fresh causal prompts of q_len tokens."""
    import torch

    from engine.kernels.prefill_attention import default_config, plan_tiles, prefill_attention

    dtype, head_dim, bs = getattr(torch, s.dtype), s.hidden // s.heads, 16
    config = config or default_config(torch.device(s.device))
    per_seq = q_len // bs
    cache = engine_layer(seqs * per_seq, s.kv_heads, bs, head_dim, dtype, s.device)
    tables = torch.arange(seqs * per_seq, dtype=torch.int32, device=s.device).view(seqs, per_seq)
    query = torch.randn(seqs * q_len, s.heads, head_dim, device=s.device).to(dtype)
    out = torch.empty_like(query)
    lens = torch.full((seqs,), q_len, dtype=torch.int32, device=s.device)
    starts = torch.arange(seqs + 1, dtype=torch.int32, device=s.device) * q_len
    tile_seq, tile_start = (torch.from_numpy(a).to(s.device)
                            for a in plan_tiles([q_len] * seqs, range(seqs), config.block_m))
    seconds = kernel_seconds(lambda: prefill_attention(out, query, cache, tables, lens, starts, tile_seq,
                                                       tile_start, head_dim ** -0.5, config), s.device)
    flops = 4 * seqs * (q_len * (q_len + 1) // 2) * s.heads * head_dim  # QK^T and PV, causal half
    return flops / seconds / 1e12
