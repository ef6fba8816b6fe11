"""The MLA decode and fused MoE kernels on the GPU: correctness against their torch
references at a DeepSeek-like size, then time and achieved bandwidth.

Each check returns a plain dict of numbers and strings for the GPU check script to
report. Times are CUDA-event medians over `runs` calls after warmup, each call
replayed from a CUDA graph (so the launchers' Python, as long as a decode kernel, is
not timed; the engine runs these kernels inside graphs too; "timing" says "eager"
where capture failed) with L2 flushed before each call, so the weights or latents
come from HBM as they would in a model's step. Keyword arguments shrink the sizes for
a smoke run on CPU (the interpreter, wall-clock times, no graph).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from benchmarks.gpu.shapes import HBM_BYTES_PER_S

L2_FLUSH_BYTES = 256 << 20  # past any L2 (H100 50 MB, H200 60 MB)


def _tolerance(dtype) -> float:
    """Max abs error allowed, relative to the reference's largest |value|: the output's
    rounding for 16-bit dtypes (bf16 has 8 bits of mantissa), accumulation order for fp32."""
    import torch

    return 1e-4 if dtype == torch.float32 else 2e-2


def _median_ms(fn: Callable[[], None], device: str, runs: int, warmup: int,
               graph: bool = True) -> tuple[float, str]:
    """(median milliseconds of one fn() call, "graph" | "eager" | "eager: <why>" | "wall
    clock"). graph=False for code that syncs with the host (it cannot be captured)."""
    import torch

    for _ in range(warmup):
        fn()
    if not device.startswith("cuda"):
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times), "wall clock"
    torch.cuda.synchronize()
    call, mode = fn, "graph" if graph else "eager"
    try:
        if graph:
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                fn()
            call = captured.replay
            call()
    except Exception as exc:  # time the eager launcher rather than nothing
        call = fn
        mode = f"eager: graph capture failed ({type(exc).__name__}: {exc})"[:200]
        torch.cuda.synchronize()
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(runs):
        flush.zero_()
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), mode


def check_mla_decode(device: str, dtype, heads: int = 16, kv_lora_rank: int = 512, rope_dim: int = 64,
                     block_size: int = 16, batch: int = 32, context: int = 2048, runs: int = 20,
                     warmup: int = 3) -> dict:
    """MLA decode over a paged latent cache: batch sequences of `context` tokens in
    shuffled blocks, `heads` query heads per rank (DeepSeek-V3: 128 heads over TP 8)."""
    import torch

    from engine.kernels.mla_decode import mla_decode_attention, mla_decode_reference, num_splits_for

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    dim = kv_lora_rank + rope_dim
    per_seq = -(-context // block_size)
    # One layer of the engine's 1-plane latent cache, viewed as every backend sees it.
    raw = torch.randn(batch * per_seq, 1, 1, 1, block_size, dim, device=device).to(dtype)
    cache = raw[:, :, 0].expand(-1, -1, 2, -1, -1).permute(0, 2, 3, 1, 4)
    tables = torch.randperm(batch * per_seq, device=device).to(torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, heads, dim, device=device).to(dtype)
    out = torch.empty(batch, heads, kv_lora_rank, dtype=dtype, device=device)
    scale = 192 ** -0.5  # DeepSeek's qk_head_dim: 128 nope + 64 rope
    splits = num_splits_for(context)

    mla_decode_attention(out, query, cache, tables, lens, scale, kv_lora_rank, num_splits=splits)
    ref = mla_decode_reference(query, cache, tables, lens, scale, kv_lora_rank)
    err = (out.float() - ref).abs().max().item()
    tol = _tolerance(dtype) * ref.abs().max().item()
    ok = err <= tol and not out.isnan().any().item()

    ms, mode = _median_ms(lambda: mla_decode_attention(out, query, cache, tables, lens, scale, kv_lora_rank,
                                                       num_splits=splits), device, runs, warmup)
    item = query.element_size()
    nbytes = batch * context * dim * item + query.numel() * item + out.numel() * item
    gbps = nbytes / (ms * 1e-3) / 1e9
    return {
        "kernel": "mla_decode_attention", "dtype": str(dtype).removeprefix("torch."),
        "shape": f"B{batch} H{heads} ctx{context} lora{kv_lora_rank}+rope{rope_dim} bs{block_size}",
        "num_splits": splits, "max_abs_err": err, "tolerance": tol,
        "tolerance_rule": f"max abs err <= {_tolerance(dtype):g} x max|ref|", "result": "pass" if ok else "fail",
        "median_ms": ms, "timing": mode, "bytes": nbytes, "gb_per_s": gbps,
        "hbm_pct_of_h200": 100 * gbps * 1e9 / HBM_BYTES_PER_S,
    }


def check_fused_moe(device: str, dtype, num_experts: int = 8, hidden: int = 2048, inter: int = 1408,
                    top_k: int = 2, router_experts: int = 8, first: int = 0,
                    token_counts: tuple[int, ...] = (1, 32, 256), runs: int = 20, warmup: int = 3) -> dict:
    """The fused MoE MLP against Experts.forward, for each token count (keys prefixed
    t<T>_): experts [first, first + num_experts) of router_experts, top_k of them per
    token by a random router. Bandwidth counts the weights of the experts hit."""
    import torch

    from engine.kernels.fused_moe import fused_moe
    from engine.model.moe import Experts

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device=device) * inter ** -0.5).to(dtype)
    # The reference: Experts.forward, a Python loop over the experts, with these weights,
    # in float32 (the exact answer for these 16-bit values: the kernel's error is its own)
    # and in x's dtype (the torch path it replaces: its error, for scale, and its time).
    exact, reference = (Experts(num_experts, hidden, inter, first).to(device=device, dtype=d)
                        for d in (torch.float32, dtype))
    with torch.no_grad():
        for module in (exact, reference):
            module.w13.copy_(w13)
            module.w2.copy_(w2)
    item = w13.element_size()
    result: dict = {"kernel": "fused_moe", "dtype": str(dtype).removeprefix("torch."),
                    "shape": f"E{num_experts} (of {router_experts}, first {first}) H{hidden} I{inter} "
                             f"top{top_k}",
                    "tolerance_rule": f"max abs err <= {_tolerance(dtype):g} x max|ref|"}
    all_ok = True
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device=device).to(dtype)
        scores = torch.randn(tokens, router_experts, device=device).softmax(-1)
        weights, experts = scores.topk(top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
        out = fused_moe(x, w13, w2, experts, weights, first)
        with torch.no_grad():
            ref = exact(x.float(), experts, weights.float())
            torch_err = (reference(x, experts, weights).float() - ref).abs().max().item()
        err = (out.float() - ref).abs().max().item()
        tol = _tolerance(dtype) * ref.abs().max().item()
        ok = err <= tol and not out.isnan().any().item()
        all_ok &= ok
        ms, mode = _median_ms(lambda: fused_moe(x, w13, w2, experts, weights, first), device, runs, warmup)
        with torch.no_grad():  # its .tolist() syncs: eager
            ref_ms, _ = _median_ms(lambda: reference(x, experts, weights), device, max(3, runs // 4), 1,
                                   graph=False)
        local = experts[(experts >= first) & (experts < first + num_experts)]
        hit = int(local.unique().numel())
        nbytes = hit * (2 * inter * hidden + hidden * inter) * item + 2 * x.numel() * item
        gbps = nbytes / (ms * 1e-3) / 1e9
        result.update({
            f"t{tokens}_max_abs_err": err, f"t{tokens}_torch_path_max_abs_err": torch_err,
            f"t{tokens}_tolerance": tol, f"t{tokens}_result": "pass" if ok else "fail",
            f"t{tokens}_median_ms": ms, f"t{tokens}_timing": mode, f"t{tokens}_experts_hit": hit,
            f"t{tokens}_bytes": nbytes, f"t{tokens}_gb_per_s": gbps,
            f"t{tokens}_hbm_pct_of_h200": 100 * gbps * 1e9 / HBM_BYTES_PER_S,
            f"t{tokens}_reference_ms": ref_ms, f"t{tokens}_speedup_vs_reference": ref_ms / ms,
        })
    result["result"] = "pass" if all_ok else "fail"
    return result


def check_moe_mla_rows(s) -> None:
    """The GPU check's rows for both kernels: correctness judged, bandwidth reported
    (the tiles are untuned). On CPU (--smoke) tiny shapes under the interpreter."""
    from benchmarks.gpu.report import row

    cuda = s.device == "cuda"
    dtype = s.dtype if cuda else "float32"
    mla = check_mla_decode(s.device, dtype, **({} if cuda else dict(heads=4, kv_lora_rank=32, rope_dim=16,
                                                                   batch=2, context=40, runs=2, warmup=1)))
    row(f"MLA decode {mla['shape']} {mla['dtype']}", f"max abs err {mla['max_abs_err']:.2e}",
        mla["tolerance_rule"], mla["result"] == "pass")
    row("MLA decode bandwidth", f"{mla['gb_per_s']:.0f} GB/s ({mla['hbm_pct_of_h200']:.0f}% of HBM), "
        f"{mla['median_ms']:.3f} ms", "(reported)")
    moe = check_fused_moe(s.device, dtype, **({} if cuda else dict(num_experts=4, hidden=64, inter=32,
                                                                  router_experts=8, first=4,
                                                                  token_counts=(1, 5), runs=2, warmup=1)))
    for t in ((1, 32, 256) if cuda else (1, 5)):
        row(f"fused MoE {moe['shape']} T{t} {moe['dtype']}", f"max abs err {moe[f't{t}_max_abs_err']:.2e}",
            moe["tolerance_rule"], moe[f"t{t}_result"] == "pass")
        row(f"fused MoE T{t} bandwidth", f"{moe[f't{t}_gb_per_s']:.0f} GB/s on {moe[f't{t}_experts_hit']} experts' "
            f"weights, {moe[f't{t}_median_ms']:.3f} ms, {moe[f't{t}_speedup_vs_reference']:.1f}x the torch loop",
            "(reported)")
