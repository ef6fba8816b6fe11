"""The LoRA SGMV kernels (engine/kernels/lora_sgmv.py) on the GPU: correctness against
LoRALinear's torch path, then the time a projection's adapters add to its base matmul,
for a decode batch of 32 rows over 4 adapters at rank 8 and 64 (the issue's shape),
beside the torch path's (BGMV-style padded bmm) time.

The projection is a Llama-3.2-1B-shaped qkv_proj (2048 -> 3072), its adapters' rank
R = 3 x the rank (q, k and v fused). Times are CUDA-event medians of CUDA-graph replays
with L2 flushed (benchmarks/gpu/mla_moe.py _median_ms). Keyword arguments shrink the
sizes for a smoke run on CPU (the interpreter, wall-clock times).
"""

from __future__ import annotations

from benchmarks.gpu.mla_moe import _median_ms


def check_lora_sgmv(device: str, dtype: str, width: int = 2048, out: int = 3072, rows: int = 32, slots: int = 4,
                    ranks: tuple[int, ...] = (8, 64), runs: int = 20, warmup: int = 3) -> dict:
    import numpy as np
    import torch

    from engine.kernels.lora_sgmv import lora_sgmv, lora_sgmv_reference, tiles_by_slot
    from engine.lora.layers import LoRALinear, LoRAStep, lora_step

    torch_dtype = getattr(torch, dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    result: dict = {"shape": f"{width}->{out} T{rows} S{slots}", "dtype": dtype}
    slot_of_row = np.arange(rows) % slots
    for rank in ranks:
        r = 3 * rank
        x = torch.randn(rows, width, generator=g).to(device=device, dtype=torch_dtype)
        base = torch.nn.Linear(width, out, bias=False).to(device=device, dtype=torch_dtype)
        a = (torch.randn(slots, r, width, generator=g) / width ** 0.5).to(device=device, dtype=torch_dtype)
        b = (torch.randn(slots, out, r, generator=g) / r ** 0.5).to(device=device, dtype=torch_dtype)
        tiles = tuple(torch.from_numpy(t).to(device) for t in tiles_by_slot(slot_of_row))
        with torch.no_grad():
            y = base(x)
            want = lora_sgmv_reference(x, y, a, b, torch.from_numpy(slot_of_row).to(device)).float()
            got = lora_sgmv(x, y.clone(), a, b, *tiles).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            result[f"r{rank}_rel_err"] = err
            result[f"r{rank}_result"] = "pass" if err <= (1e-4 if dtype == "float32" else 2e-2) else "fail"
            wrapped = LoRALinear(base, torch.arange(width), torch.arange(out), slots, r, torch_dtype, device)
            wrapped.lora_a.copy_(a)
            wrapped.lora_b.copy_(b)
            padded = LoRAStep.of(slot_of_row, torch.device("cpu"))  # the torch path's grouping, moved over
            assert padded is not None and padded.gather is not None and padded.mask is not None
            padded.gather, padded.mask = padded.gather.to(device), padded.mask.to(device)
            base_ms, mode = _median_ms(lambda: base(x), device, runs, warmup)
            sgmv_ms, _ = _median_ms(lambda: lora_sgmv(x, base(x), a, b, *tiles), device, runs, warmup)

            def torch_path() -> None:
                with lora_step(padded):
                    wrapped(x)
            torch_ms, _ = _median_ms(torch_path, device, runs, warmup)
        result.update({f"r{rank}_base_ms": base_ms, f"r{rank}_sgmv_ms": sgmv_ms, f"r{rank}_torch_ms": torch_ms,
                       "timing": mode})
    return result


def check_lora_rows(s) -> None:
    from benchmarks.gpu.report import row

    cuda = s.device == "cuda"
    res = check_lora_sgmv(s.device, s.dtype if cuda else "float32",
                          **({} if cuda else dict(width=64, out=96, rows=8, ranks=(4, 16), runs=2, warmup=1)))
    for rank in ((8, 64) if cuda else (4, 16)):
        row(f"LoRA SGMV {res['shape']} rank {rank} {res['dtype']}", f"max rel err {res[f'r{rank}_rel_err']:.2e}",
            "<= 2e-2 (bf16), 1e-4 (fp32)", res[f"r{rank}_result"] == "pass")
        base, sgmv, torch_ms = (res[f"r{rank}_{k}_ms"] for k in ("base", "sgmv", "torch"))
        row(f"LoRA projection rank {rank}: base + adapters / base", f"{sgmv / base:.2f}x ({sgmv:.3f} vs "
            f"{base:.3f} ms; torch path {torch_ms / base:.2f}x; {res['timing']})", "(reported)")
