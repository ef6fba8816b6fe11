"""Roofline report: the engine's measured step times against their analytic floors.

    .venv/bin/python -m benchmarks.offline roofline --device cpu --plots docs/img/ --json r.json
    .venv/bin/python -m benchmarks.offline roofline --model DIR --device cuda --batches 64,256 --contexts 1024
    .venv/bin/python -m benchmarks.offline roofline --analytic-only --dtype bfloat16 --roof h200
    .venv/bin/python -m benchmarks.offline roofline cdf --json a.json b.json --labels disaggregated,colocated \\
        --out docs/img/serve-cdf.png

For a model directory (default: the demo model) it times decode steps at a steady batch
for each --batches x --contexts, and one prefill step of --prefill-chunk new tokens after
--prefill-context cached ones, on engine.LLM. Each is set against its floor: per kernel
class (linears, attention, KV write, lm_head, elementwise), the larger of bytes /
bandwidth and FLOPs / peak, summed over classes (benchmarks/offline/roofline/analytic.py). The
roofs: on CPU the measured torch.mm rate and copy bandwidth, on CUDA the H200's 4.23 TB/s
and 760 TFLOP/s (--roof picks). Prints a table; --json writes the report, --plots the
roofline and the step-time-vs-batch PNGs. `cdf` plots TTFT and TPOT CDFs from two or
more benchmarks/serving/serve.py --json reports. The parts live in benchmarks/offline/roofline/.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a file, this script's folder heads sys.path, where a module could shadow a
# package or the standard library (elastic/trace.py: `trace`): the repo root goes first.
_REPO_ROOT = Path(__file__).resolve().parents[3]
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.offline.roofline.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
