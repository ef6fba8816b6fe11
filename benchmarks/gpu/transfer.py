"""Row 6 of the GPU check: KV transfer between two processes on the GPU (cuda_ipc, and
nixl if its wheel came along), and the copy kernel a cuda_ipc write issues, alone."""

from __future__ import annotations

from importlib import import_module

from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import Setup
from benchmarks.gpu.timing import kernel_seconds


def check_copy_kernels(s: Setup) -> None:
    """GPU time of the copy a cuda_ipc write issues (256 MiB in 2 MiB runs, scattered),
    in one process: how much of a transfer is the data plane."""
    import torch

    blocks, run = 512, 4  # 512 KiB blocks
    src = torch.randn(blocks, 512 << 8, device=s.device).view(torch.uint8)  # [blocks, 512 KiB]
    dst = torch.empty_like(src)
    runs = [(i * run, (blocks // run - 1 - i) * run, run) for i in range(blocks // run)]
    for name, a, b in (("uint8", src, dst), ("int64", src.view(torch.int64), dst.view(torch.int64))):
        seconds = kernel_seconds(lambda: torch._foreach_copy_([b[d:d + n] for _, d, n in runs],
                                                              [a[x:x + n] for x, _, n in runs]), s.device)
        row(f"fused copy of 128 runs as {name}", f"{src.numel() / seconds / 1e9:.0f} GB/s", "(info)")


def with_nixl(first: str, check: str) -> list[str]:
    """[first], and nixl if it imports here (a row `check` says it was skipped if not)."""
    try:
        import_module("nixl")  # carried as a wheel; the image lacks it
    except ImportError:
        row(check, "nixl not installed here", "(skipped)")
        return [first]
    return [first, "nixl"]


def check_transfer(s: Setup) -> None:
    from benchmarks.kv.transfer import run_transport

    for name in with_nixl("cuda_ipc", "nixl transfer"):
        sizes, desc = ([256 << 20, 1 << 30], 2 << 20) if s.device != "cpu" else ([4 << 20], 1 << 20)
        # 512 KiB blocks: one block of the Llama-3.2-1B-shaped model in bf16 (16 layers).
        gib = run_transport(name, sizes, [desc], repeats=3, device=s.device,
                            block_bytes=(512 << 10) if s.device != "cpu" else (32 << 10))
        for i, size in enumerate(sizes):
            gbs = gib[(size, desc)] * 2**30 / 1e9
            row(f"{name} transfer {size >> 20} MiB, {desc >> 20} MiB desc", f"{gbs:.1f} GB/s",
                ">= 150 GB/s" if i == 0 else "(info)", gbs >= 150 if i == 0 else None)
