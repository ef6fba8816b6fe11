"""Serving benchmarks: a deployment behind its router, measured over HTTP or on its sockets.

    python -m benchmarks.serving NAME [ARGS]     # NAME --help for its options; no NAME: the list
"""

from benchmarks.entry import run_group

BENCHMARKS = {
    "serve": "benchmarks.serving.serve",
    "serve_compare": "benchmarks.serving.serve_compare",
    "plane_latency": "benchmarks.serving.plane_latency",
    "router_memory": "benchmarks.serving.router_memory",
    "protocol_codec": "benchmarks.serving.protocol_codec",
    "across_hosts": "benchmarks.serving.across_hosts",
    "multi_turn": "benchmarks.serving.multi_turn",
    "slo": "benchmarks.serving.slo",
}

if __name__ == "__main__":  # not when a spawned child imports this module as its main
    run_group("benchmarks.serving", BENCHMARKS)
