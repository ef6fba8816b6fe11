"""Diagnostic --only ucx: nixl transfer GB/s under each UCX setting, a fresh process
per setting (helpers in benchmarks/gpu/profiling.py)."""

from __future__ import annotations

import os
import time
from importlib import import_module

from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import Setup


def check_ucx(s: Setup) -> None:
    """nixl transfer GB/s under each profiling.UCX_SETTINGS entry: benchmarks/kv/transfer.py
    in a fresh process per setting (UCX and NIXL read their environment at init), with a
    timeout per run and a time budget for the section."""
    from benchmarks.gpu import profiling

    try:
        import_module("nixl")  # carried as a wheel; the image lacks it
    except ImportError:
        row("nixl UCX settings", "nixl not installed here", "(skipped)")
        return
    gpu = s.device != "cpu"
    # As the transfer section: 2 MiB descriptors of 512 KiB blocks (the 1B model's block).
    sizes = [256, 1024] if gpu else [4]
    cmd = profiling.transfer_command(s.device, sizes, 2048 if gpu else 1024, 512 if gpu else 32)
    budget_s, per_run_s = (170.0, 60.0) if gpu else (300.0, 45.0)
    start = time.perf_counter()
    for setting in profiling.UCX_SETTINGS:
        left = budget_s - (time.perf_counter() - start)
        if left < 20:
            row(f"nixl UCX {setting.label}", "skipped: the section's time budget is spent", "(skipped)")
            continue
        run = profiling.run_with_timeout(cmd, profiling.child_env(os.environ, setting), min(per_run_s, left))
        gbs = profiling.parse_gbs(run.output)
        if setting.diagnose:
            for line in profiling.ucx_diagnosis(run.output):
                print(f"    ucx: {line}", flush=True)
        if run.returncode == 0 and all(size in gbs for size in sizes):
            measured = ", ".join(f"{size} MiB {gbs[size]:.1f}" for size in sizes) + f" GB/s ({run.seconds:.0f} s)"
            row(f"nixl UCX {setting.label}", measured, ">= 150 GB/s", gbs[sizes[0]] >= 150)
        else:  # keep what it measured before it failed or ran out of time
            why = "timed out" if run.returncode is None else f"exit {run.returncode}"
            got = "".join(f"{size} MiB {v:.1f} GB/s, " for size, v in gbs.items())
            row(f"nixl UCX {setting.label}", f"{why} after {run.seconds:.0f} s: {got}"
                f"{profiling.failure_line(run.output)}", "(error)")
