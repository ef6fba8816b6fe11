"""The tile sweep (--only tune): every decode and prefill launch config, the fastest
made this run's GPU config."""

from __future__ import annotations

from benchmarks.gpu.bandwidth import decode_bandwidth, prefill_rate
from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import HBM_BYTES_PER_S, Setup


def check_tuning(s: Setup) -> None:
    """Sweep tile sizes and launch options; the winners become this run's GPU configs
    (and, copied by hand, engine/kernels/*.GPU_CONFIG)."""
    import itertools

    from engine.kernels import decode_attention as decode_mod
    from engine.kernels import prefill_attention as prefill_mod
    from engine.kernels.common import LaunchConfig

    grid = ((32, 64, 128), (2, 4, 8), (2, 3, 4)) if s.device != "cpu" else ((32,), (4,), (1,))
    results = []
    for block_n, warps, stages in itertools.product(*grid):
        config = LaunchConfig(block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            times = [decode_bandwidth(s, d, config) for d in (64, 128)]
        except Exception as exc:  # e.g. out of shared memory: skip the config
            print(f"  decode {config}: {type(exc).__name__}", flush=True)
            continue
        pct = [100 * nbytes / sec / HBM_BYTES_PER_S for sec, nbytes in times]
        print(f"  decode n{block_n} w{warps} s{stages}: {pct[0]:.0f}% (d64) {pct[1]:.0f}% (d128)", flush=True)
        results.append((sum(sec for sec, _ in times), config, pct))
    _, best, pct = min(results, key=lambda r: r[0])
    decode_mod.GPU_CONFIG = best
    row("decode tiles", f"n{best.block_n} w{best.num_warps} s{best.num_stages}: {pct[0]:.0f}% / {pct[1]:.0f}%",
        "(chosen)")

    grid = (((64, 128), (32, 64), (4, 8), (2, 3)) if s.device != "cpu" else ((32,), (32,), (4,), (1,)))
    results = []
    for block_m, block_n, warps, stages in itertools.product(*grid):
        config = LaunchConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            rate = prefill_rate(s, config)
        except Exception as exc:
            print(f"  prefill {config}: {type(exc).__name__}", flush=True)
            continue
        print(f"  prefill m{block_m} n{block_n} w{warps} s{stages}: {rate:.0f} TFLOP/s", flush=True)
        results.append((rate, config))
    rate, best = max(results, key=lambda r: r[0])
    prefill_mod.GPU_CONFIG = best
    row("prefill tiles", f"m{best.block_m} n{best.block_n} w{best.num_warps} s{best.num_stages}: "
        f"{rate:.0f} TFLOP/s", "(chosen)")
