"""Offline engine benchmarks: engine.LLM and EngineCore in one process, no router.

    python -m benchmarks.offline NAME [ARGS]     # NAME --help for its options; no NAME: the list
"""

from benchmarks.entry import run_group

BENCHMARKS = {
    "offline_throughput": "benchmarks.offline.offline_throughput",
    "engine_ab": "benchmarks.offline.engine_ab",
    "host_overhead": "benchmarks.offline.host_overhead",
    "cpu_kernels": "benchmarks.offline.cpu_kernels",
    "tp_cpu": "benchmarks.offline.tp_cpu",
    "moe_cpu": "benchmarks.offline.moe_cpu",
    "fp8_kv": "benchmarks.offline.fp8_kv",
    "roofline": "benchmarks.offline.roofline",
    "parallel_sampling": "benchmarks.offline.parallel_sampling",
    "speculative": "benchmarks.offline.speculative",
    "speculative_cost": "benchmarks.offline.speculative_cost",
    "structured": "benchmarks.offline.structured",
    "sliding_window": "benchmarks.offline.sliding_window",
    "window_pools": "benchmarks.offline.window_pools",
    "lora": "benchmarks.offline.lora",
}

if __name__ == "__main__":  # not when a spawned child imports this module as its main
    run_group("benchmarks.offline", BENCHMARKS)
