"""KV transfer benchmarks: one transport's writes between two processes, on this machine or
on two hosts of the multi-host test bed (link).

    python -m benchmarks.kv NAME [ARGS]     # NAME --help for its options; no NAME: the list
"""

from benchmarks.entry import run_group

BENCHMARKS = {
    "transfer": "benchmarks.kv.transfer",
    "tp_transfer": "benchmarks.kv.tp_transfer",
    "nccl_rendezvous": "benchmarks.kv.nccl_rendezvous",
    "link": "benchmarks.kv.link",
    "stream": "benchmarks.kv.stream",
    "store": "benchmarks.kv.store",
}

if __name__ == "__main__":  # not when a spawned child imports this module as its main
    run_group("benchmarks.kv", BENCHMARKS)
