"""Row 1b of the GPU check: the grammar-mask kernel (engine/kernels/bitmask.py) against
its torch reference, and its time at batch 256 over the model's vocabulary."""

from __future__ import annotations

from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import Setup


def check_bitmask(s: Setup) -> None:
    import torch

    from engine.kernels.bitmask import apply_bitmask_triton

    batch, vocab = (256, s.vocab) if s.device == "cuda" else (8, s.vocab)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=gen).to(s.device)
    words = (vocab + 31) // 32
    masks = torch.randint(-2**31, 2**31 - 1, (batch, words), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.arange(0, batch, 2, dtype=torch.int32)  # half the batch constrained
    bits = ((masks.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1).flatten(1)[:, :vocab].bool()
    expected = logits.cpu().clone()
    expected[rows.long()] = expected[rows.long()].masked_fill(~bits[rows.long()], float("-inf"))
    got = logits.clone()
    masks_dev, rows_dev = masks.to(s.device), rows.to(s.device)
    apply_bitmask_triton(got, masks_dev, rows_dev)
    same = torch.equal(got.cpu(), expected)
    row(f"bitmask b{batch} v{vocab}", "bit-exact" if same else "differs", "bit-exact", same)
    if s.device != "cuda":
        return
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        apply_bitmask_triton(got, masks_dev, rows_dev)
    start.record()
    for _ in range(20):
        apply_bitmask_triton(got, masks_dev, rows_dev)
    end.record()
    end.synchronize()
    us = start.elapsed_time(end) / 20 * 1e3
    row(f"bitmask b{batch}/2 rows v{vocab} time", f"{us:.0f} us", "<= 50 us", us <= 50)
