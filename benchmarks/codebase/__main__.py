"""The code's own shape: what issue 35 counted to say where features tangle.

    python -m benchmarks.codebase NAME [ARGS]     # NAME --help for its options; no NAME: the list
"""

from benchmarks.entry import run_group

BENCHMARKS = {
    "shape": "benchmarks.codebase.shape",
}

if __name__ == "__main__":  # not when a spawned child imports this module as its main
    run_group("benchmarks.codebase", BENCHMARKS)
