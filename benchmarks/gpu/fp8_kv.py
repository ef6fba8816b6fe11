"""The GPU check's fp8 rows (issue 39): the decode kernel on an fp8 KV cache (its
output against the same kernel over the cache widened to bf16, and its bandwidth for
the bytes it reads, beside bf16's in the same run), fp8 GEMM TFLOP/s against bf16
(torch._scaled_mm, what fp8 weights run; Fp8Linear's output checked first), and offline throughput with an fp8
cache against the bf16 cache on the engine rows' model."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu.bandwidth import decode_bandwidth, engine_layer
from benchmarks.gpu.engine_rows import offline_rate
from benchmarks.gpu.model import build_model, free_memory, make_llm, prompts
from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import HBM_BYTES_PER_S, Setup
from benchmarks.gpu.timing import kernel_seconds


def check_fp8_kv(s: Setup, work: Path) -> None:
    import torch

    check_fp8_decode_output(s)
    head_dim = 128
    wide, wide_bytes = decode_bandwidth(s, head_dim)
    narrow, narrow_bytes = decode_bandwidth(s, head_dim, cache_dtype=torch.float8_e4m3fn)
    pct = 100 * narrow_bytes / narrow / HBM_BYTES_PER_S
    row(f"fp8 decode kernel bandwidth b{s.bw_batch} ctx{s.bw_context} d{head_dim}",
        f"{narrow_bytes / narrow / 1e12:.2f} TB/s ({pct:.0f}%, {narrow * 1e6:.0f} us; bf16 cache "
        f"{wide * 1e6:.0f} us = {wide / narrow:.2f}x)", ">= 85%", pct >= 85)
    check_fp8_gemm(s)
    model_dir = build_model(s, work / "fp8kv", s.dtype)
    workload = prompts(s, s.requests, s.prompt_len, seed=3)
    rates = {}
    for kv in ("auto", "fp8"):
        llm = make_llm(model_dir, s, s.dtype, kv_cache_dtype=kv, max_num_seqs=max(s.step_batches),
                       max_num_batched_tokens=8192 if s.device != "cpu" else 64)
        rates[kv] = offline_rate(llm, s, workload)
        blocks = llm.core.kv.pool.num_blocks
        del llm
        free_memory(s)
        row(f"offline throughput, {s.dtype} weights, kv_cache_dtype {kv}",
            f"{rates[kv]:,.0f} tok/s, {blocks} KV blocks", "(info)")
    row("offline throughput, fp8 / bf16 KV cache", f"{rates['fp8'] / rates['auto']:.2f}x", "(info)")


def check_fp8_decode_output(s: Setup) -> None:
    """The kernel over an fp8 cache against itself over that cache widened to bf16."""
    import torch

    from engine.kernels.decode_attention import decode_attention, num_splits_for

    b, ctx, bs, head_dim = 8, 700, 16, 128
    per_seq = -(-ctx // bs)
    cache = engine_layer(b * per_seq, s.kv_heads, bs, head_dim, torch.float8_e4m3fn, s.device)
    wide = cache.to(getattr(torch, s.dtype))
    tables = torch.randperm(b * per_seq, device=s.device).to(torch.int32).view(b, per_seq)
    query = torch.randn(b, s.heads, head_dim, device=s.device).to(wide.dtype)
    rows = torch.arange(b, dtype=torch.int32, device=s.device)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=s.device)
    out, expected = torch.empty_like(query), torch.empty_like(query)
    decode_attention(out, query, cache, rows, tables, lens, 0.1, num_splits_for(ctx))
    decode_attention(expected, query, wide, rows, tables, lens, 0.1, num_splits_for(ctx))
    err = float((out.float() - expected.float()).abs().max() / expected.float().abs().max())
    ok = err <= 1e-2 and not bool(out.isnan().any())
    row("fp8 decode kernel vs the bf16-widened cache", f"max rel err {err:.1e}", "<= 1e-2", ok)


def check_fp8_gemm(s: Setup) -> None:
    """Fp8Linear's _scaled_mm path against the same weights dequantized; then
    torch._scaled_mm (per-tensor scales) against a bf16 matmul of the same shape."""
    import torch

    if not s.device.startswith("cuda") or torch.cuda.get_device_capability() < (8, 9):
        row("fp8 GEMM", "no fp8 tensor cores here (sm_89+)", "(info)")
        return
    from engine.model.fp8_linear import Fp8Linear

    linear = torch.nn.Linear(2048, 8192, bias=True, device=s.device, dtype=torch.bfloat16)
    fp8 = Fp8Linear.quantize(linear)
    x = torch.randn(64, 2048, device=s.device, dtype=torch.bfloat16)
    got = fp8(x).float()
    want = torch.nn.functional.linear(x, fp8.dequantized(torch.bfloat16), fp8.bias).float()
    err = float((got - want).norm() / want.norm())
    row("Fp8Linear (_scaled_mm, per-token activation scales) vs its dequantized weight",
        f"relative error {err:.1e}", "<= 5e-2", err <= 5e-2 and not bool(got.isnan().any()))
    m, k, n = 4096, 4096, 14336
    a = torch.randn(m, k, device=s.device).to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device=s.device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=s.device)
    a16, w16 = a.to(torch.bfloat16), w.to(torch.bfloat16)
    fp8 = kernel_seconds(lambda: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                         s.device)
    bf16 = kernel_seconds(lambda: a16 @ w16.t(), s.device)
    flops = 2 * m * k * n
    row(f"fp8 GEMM {m}x{k}x{n}", f"{flops / fp8 / 1e12:.0f} TFLOP/s vs bf16 {flops / bf16 / 1e12:.0f} "
        f"= {bf16 / fp8:.2f}x", "(info)")
