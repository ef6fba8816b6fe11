"""Prometheus metrics of the router, with the workers' own figures folded in at scrape.

Latencies follow vLLM's definitions: time to first token (request received -> first
token sent), inter-token latency (between consecutive token batches, per token), and
end-to-end latency. Worker gauges (KV blocks, queue depths, remote prefills, local
fallbacks, late KV writes dropped) are asked of every decode worker on each scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
WORKER_GAUGES = {  # stats key -> help
    "num_blocks": "KV blocks in the worker's pool",
    "free_blocks": "KV blocks free (or only cached) in the worker's pool",
    "running": "requests running on the worker",
    "waiting": "requests waiting on the worker",
    "waiting_for_kv": "requests waiting for pushed prompt KV",
    "remote": "requests prefilled on a prefill worker (total)",
    "local": "requests prefilled on the decode worker (total)",
    "fallbacks": "remote prefills that fell back to local prefill (total)",
    "late_writes_dropped": "KV writes refused as late or unreserved (total)",
}


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "request received to first token",
                              registry=r, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "time between tokens",
                             registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "request received to last token",
                             registry=r, buckets=LATENCY_BUCKETS)
        self.requests = Counter("pdserve_requests", "requests routed, by prefill placement",
                                ["prefill"], registry=r)
        self.finished = Counter("pdserve_requests_finished", "requests finished, by reason",
                                ["reason"], registry=r)
        self.rejected = Counter("pdserve_requests_rejected", "requests refused, by HTTP status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens routed", registry=r)
        self.cached_tokens = Counter("pdserve_router_predicted_cached_tokens",
                                     "prompt tokens the routing policy expected to be cached", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "tokens generated", registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "requests the router is serving", registry=r)
        self.worker = {key: Gauge(f"pdserve_worker_{key}", help_, ["worker"], registry=r)
                       for key, help_ in WORKER_GAUGES.items()}

    def set_worker(self, name: str, stats: dict) -> None:
        for key, gauge in self.worker.items():
            if key in stats:
                gauge.labels(worker=name).set(stats[key])

    def render(self) -> bytes:
        return generate_latest(self.registry)
