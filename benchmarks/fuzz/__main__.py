"""Fuzzers: random schedules and scale events, every answer checked against an oracle.

    python -m benchmarks.fuzz NAME [ARGS]     # NAME --help for its options; no NAME: the list
"""

from benchmarks.entry import run_group

BENCHMARKS = {
    "schedules": "benchmarks.fuzz.schedules",
    "scale": "benchmarks.fuzz.scale",
    "groups": "tests.fuzz.groups",
    "hosts": "benchmarks.fuzz.hosts",
}

if __name__ == "__main__":  # not when a spawned child imports this module as its main
    run_group("benchmarks.fuzz", BENCHMARKS)
