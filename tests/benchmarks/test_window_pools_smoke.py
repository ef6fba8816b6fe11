"""benchmarks/offline/window_pools.py on a small mixed shape (1 full layer, 5 sliding,
window 128): arm 2's sliding pool holds the window's blocks and no more while a sequence
decodes far past it (it releases), arm 1 holds every block, the capacities it reports
run at once in the engine's KVCacheManager and one more does not; and the real shapes
are read as the brief says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.offline.window_pools import BLOCK, GEMMA2_2B, GEMMA3_270M, Shape, measure, shape_of

ROOT = Path(__file__).resolve().parents[2]
TINY = Shape("tiny", layers=6, n_full=1, n_sliding=5, window=128, arm1_window=0, kv_heads=1, head_dim=8,
             max_context=4096, budget_blocks=100)


def test_the_sliding_pool_releases_and_the_capacities_run():
    rows = {(r["schedule"], r["multiple"]): r for r in measure(TINY, 2, step_tokens=32, confirm=True)}
    decode8 = rows["64 + decode to T", 8]  # 64 prompt tokens, decoded to 1024
    assert decode8["arm1_blocks"] == decode8["arm2_full_blocks"] == 64  # every block, both
    assert decode8["arm2_sliding_blocks"] == 128 // BLOCK + 1  # the window's and the one it grows into
    assert abs(decode8["ratio"] - decode8["closed_form"]) < 1e-9
    assert decode8["capacity_arm2"] > 2 * decode8["capacity_arm1"]
    long8 = rows["T prompt + 64", 8]  # a 1024-token prompt in chunks of 32: the window and a chunk
    assert long8["arm2_sliding_blocks"] == (128 + 32) // BLOCK  # 8 before the step, 2 for its chunk
    at_window = rows["64 + decode to T", 1]  # nothing before the window to release
    assert at_window["ratio"] == 1.0 and at_window["capacity_arm2"] == at_window["capacity_arm1"]
    assert all(r["confirmed"] for r in rows.values()), [k for k, r in rows.items() if not r["confirmed"]]


def test_the_real_shapes():
    g3, g2 = shape_of("g3", GEMMA3_270M, 1000), shape_of("g2", GEMMA2_2B, 8000)
    assert (g3.layers, g3.n_full, g3.n_sliding, g3.window, g3.kv_heads, g3.head_dim) == (18, 3, 15, 512, 1, 256)
    assert (g2.layers, g2.n_full, g2.n_sliding, g2.window, g2.kv_heads, g2.head_dim) == (26, 13, 13, 4096, 4, 256)
    assert g3.arm1_window == g2.arm1_window == 0  # the engine releases nothing for a mixed model


def test_the_command_runs(tmp_path: Path):
    out = tmp_path / "pools.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.offline", "window_pools", "--models", "gemma3",
                          "--no-confirm", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| 64 + decode to T | 4096 (8x) | 256 | 256 + 33 |" in run.stdout
    assert len(json.loads(out.read_text())["rows"]) == 8
