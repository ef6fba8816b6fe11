"""P5 and P6, disaggregated against colocated, from two benchmarks/serving/serve.py JSONs of the
same command (same seeds and load points), as a markdown table for docs/benchmarks/ (2026-12-02-serving-p5-p6.md):

    .venv/bin/python -m benchmarks.serving serve_compare results/disagg.json results/coloc.json
    .venv/bin/python -m benchmarks.serving serve_compare D.json C.json --p5 "rate 0.1/s" --p6 "concurrency 8"

P5: TTFT p50 and p99 ratio at the low load point (default: the first both ran); P6:
p99 TPOT ratio at the high one (default: the last), with both throughputs, since P6
compares at equal throughput. Per seed, pooled over seeds, and the seeds' spread
(benchmarks/serving/compare.py). Exit status 2 for files it cannot compare (not serve.py
JSONs, or of different commands); 1 when a load point of the table had failed requests
(the table says "no verdict" there).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.serving.compare import NO_VERDICT, compare  # noqa: E402
from benchmarks.serving.compare_inputs import load_report  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="serve_compare.py", description=__doc__.split("\n\n")[0])
    p.add_argument("disaggregated", help="serve.py --json of the disaggregated setup")
    p.add_argument("colocated", help="serve.py --json of the colocated twin, same command")
    p.add_argument("--p5", default=None, help='P5\'s load point, e.g. "rate 0.1/s" (default: the first)')
    p.add_argument("--p6", default=None, help='P6\'s load point, e.g. "concurrency 8" (default: the last)')
    args = p.parse_args(argv)
    try:
        table = compare(*(load_report(path) for path in (args.disaggregated, args.colocated)), args.p5, args.p6)
    except ValueError as exc:
        p.error(str(exc))
    print(table)
    if NO_VERDICT in table:
        sys.exit(f"{p.prog}: requests failed at a load point of the table ({NO_VERDICT} there): "
                 "the completed ones are not the setup's latency; find why (the reports' 'errors') and rerun")


if __name__ == "__main__":
    main()
