"""benchmarks/gpu_check.py --smoke: every default section runs on CPU (tiny shapes, the
Triton interpreter for the kernels, a served dummy-weight Llama over shm), so the GPU
script cannot rot between the runs on a device. Timings are not judged on CPU;
correctness rows and errors are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("[kernels vs reference]", "[grammar mask kernel]", "[float32 fidelity]", "[decode bandwidth]",
            "[engine]", "[KV offload tiers]", "[speculative decoding]", "[serve]")


def test_the_smoke_run_passes_every_section() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    missing = [name for name in SECTIONS if name not in out.stdout]
    assert not missing, f"sections not run: {missing}\n{log[-4000:]}"
    assert " 0 failed" in out.stdout and "served greedy text, disaggregated == colocated" in out.stdout
