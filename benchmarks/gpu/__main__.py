"""The GPU check's sections; benchmarks/gpu_check.py is its command line (kept at that path).

    python -m benchmarks.gpu NAME [ARGS]     # NAME --help for its options; no NAME: the list
"""

from benchmarks.entry import run_group

BENCHMARKS = {
    "check": "benchmarks.gpu_check",
    "profiling": "benchmarks.gpu.profiling",
}

if __name__ == "__main__":  # not when a spawned child imports this module as its main
    run_group("benchmarks.gpu", BENCHMARKS)
