"""Chaos and soak: a real deployment under load while its workers are killed and attacked.

    python -m benchmarks.chaos NAME [ARGS]     # NAME --help for its options; no NAME: the list
"""

from benchmarks.entry import run_group

BENCHMARKS = {
    "run": "benchmarks.chaos.run",
    "ray_recovery": "benchmarks.chaos.ray_recovery",
}

if __name__ == "__main__":  # not when a spawned child imports this module as its main
    run_group("benchmarks.chaos", BENCHMARKS)
