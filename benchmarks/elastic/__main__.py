"""Elastic pools: fixed pools against pools scaled at runtime, on a three-phase trace.

    python -m benchmarks.elastic NAME [ARGS]     # NAME --help for its options; no NAME: the list
"""

from benchmarks.entry import run_group

BENCHMARKS = {
    "autoscale": "benchmarks.elastic.autoscale",
}

if __name__ == "__main__":  # not when a spawned child imports this module as its main
    run_group("benchmarks.elastic", BENCHMARKS)
