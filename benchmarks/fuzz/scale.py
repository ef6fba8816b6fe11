"""More seeds of the scale fuzzer (tests/fuzz/scale.py) than `make test` runs: random
scale events on a live local deployment of worker processes while random greedy
requests stream, every answer checked against the colocated oracle.

    .venv/bin/python -m benchmarks.fuzz scale --seeds 0-9 [--model DIR]

Without --model it builds the tests' tiny Llama in a temporary directory. Prints one
line per seed and the failures (exit status 1 if any)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cluster.serve import build  # noqa: E402
from tests.fuzz.common import Oracle  # noqa: E402
from tests.fuzz.scale import run_scale_seed  # noqa: E402
from tests.fuzz.test_fuzz_scale import scale_config  # noqa: E402
from tests.http_server import serving  # noqa: E402


def seeds(spec: str) -> list[int]:
    low, _, high = spec.partition("-")
    return list(range(int(low), int(high or low) + 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--model", default=None)
    parser.add_argument("--events", type=int, default=4)
    parser.add_argument("--requests", type=int, default=24)
    args = parser.parse_args()
    model = Path(args.model) if args.model else None
    if model is None:
        from tests.tiny_models import build_tiny_model
        model = build_tiny_model("llama", Path(tempfile.mkdtemp()) / "llama")
    config = scale_config(model)
    logging.basicConfig(level=logging.ERROR)
    oracle = Oracle(model)
    workers, router = build(config)
    failures: list[str] = []
    try:
        with serving(router, config.router.port) as base:
            for seed in seeds(args.seeds):
                start = time.monotonic()
                run = run_scale_seed(seed, base, config.model, router.scaler, oracle, args.events, args.requests)
                moved = sum(e["result"]["moved_requests"] for e in run.events if "result" in e)
                refused = sum("refused" in e for e in run.events)
                print(json.dumps({"seed": seed, "requests": run.requests, "events": len(run.events),
                                  "refused": refused, "moved": moved,
                                  "failures": len(run.failures), "seconds": round(time.monotonic() - start, 1)}),
                      flush=True)
                failures += run.failures
    finally:
        workers.stop()
    for f in failures:
        print(f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
