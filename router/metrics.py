"""Prometheus metrics of the router, with the workers' own figures folded in at scrape.

Latencies follow vLLM's definitions: time to first token (request received -> first
token sent), inter-token latency (between consecutive token batches, per token), and
end-to-end latency. Each finished request also reports its phases, as its decode
worker measured them:

    queue     waiting on the decode worker to be scheduled (after its KV arrived, for a
              remote prefill)
    prefill   local: first scheduled -> first token; remote: the prefill worker's
              time from receiving it to its KV computed (its queue included)
    transfer  remote only: received -> KV complete on the decode worker, minus the
              prefill: the hop to the prefill worker (and its wait there for the
              step it was computing to end), writes compute did not hide, the
              notification
    decode    first token -> last token

and, a part of transfer, not added to the others:

    kv_write  remote only: the prefill worker's time from the prompt's KV computed to
              its last write acknowledged (the writes compute did not hide); each
              worker's loop handles acknowledgements between its steps, so under
              load this includes a wait for the step each is in

Time per output token (TPOT) follows vLLM too: (end-to-end - time to first token) /
(output tokens - 1), for requests with at least two output tokens.

Worker gauges (KV blocks, queue depths, preemptions; a decode worker's remote
prefills, local fallbacks, saturation, KV bytes and transfer seconds and failures,
late KV writes dropped; a prefill worker's jobs, tokens computed, blocks written,
prefills done and failed) and step histograms (router/worker_metrics.py) are asked of
every live worker of both pools on each scrape, labelled by worker and role (decode,
prefill); the prefix-cache hit rate is pdserve_prefix_cache_hit_tokens /
pdserve_prompt_tokens.

A speculating decode worker's counters (drafts, draft tokens, accepted tokens, by draft
position, requests that stopped speculating) are counters named as vLLM's under
pdserve_spec_decode_ (router/worker_metrics.py); the acceptance rate is
pdserve_spec_decode_num_accepted_tokens / pdserve_spec_decode_num_draft_tokens, and
the mean accepted length 1 + pdserve_spec_decode_num_accepted_tokens /
pdserve_spec_decode_num_drafts (docs/api.md).

Supervision (router/health.py): decode workers the router considers alive, in total
and per worker, and requests failed over from a dead decode worker to a live one.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from protocol import WorkerStats
from router.worker_metrics import WorkerHistograms, WorkerKVTiers, WorkerSpecDecode

# From 0.1 ms: a KV transfer on one GPU (phase kv_write) takes well under 5 ms, and
# a quantile read from buckets is only as fine as they are.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Prompt tokens per request: steps of 1.5x and 2x, fine enough for the planner to place
# router.remote_prefill_min_tokens within a prompt-length spread (cluster/autoscale/).
PROMPT_LENGTH_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192,
                         12288, 16384, 32768)
WORKER_GAUGES = {  # WorkerStats field -> (metric, help); a worker reports those of its role
    "num_blocks": ("pdserve_worker_num_blocks", "KV blocks in the worker's pool"),
    "free_blocks": ("pdserve_worker_free_blocks", "KV blocks free (or only cached) in the worker's pool"),
    "running": ("pdserve_worker_running", "requests running on the worker"),
    "waiting": ("pdserve_worker_waiting", "requests waiting on the worker"),
    "preemptions": ("pdserve_worker_preemptions", "running requests preempted to free KV blocks (total)"),
    "waiting_for_kv": ("pdserve_worker_waiting_for_kv", "requests waiting for pushed prompt KV"),
    "remote": ("pdserve_worker_remote", "requests prefilled on a prefill worker (total)"),
    "local": ("pdserve_worker_local", "requests prefilled on the decode worker (total)"),
    "fallbacks": ("pdserve_worker_fallbacks", "remote prefills that fell back to local prefill (total)"),
    "late_writes_dropped": ("pdserve_worker_late_writes_dropped", "KV writes refused as late or unreserved (total)"),
    "quarantined_blocks": ("pdserve_worker_quarantined_blocks",
                           "KV blocks held out of use until a prefill worker confirms a given-up write (fence)"),
    "fenced_refusals": ("pdserve_worker_fenced_refusals",
                        "prompts not sent to a prefill worker whose unconfirmed writes hold too many blocks (total)"),
    "kv_overwritten": ("pdserve_worker_kv_overwritten",
                       "writes for a given-up reservation that landed after all, in fenced blocks (total)"),
    "kv_overwritten_in_use": ("pdserve_worker_kv_overwritten_in_use",
                              "writes that landed in released blocks: a broken fence, 0 expected (total)"),
    "saturated": ("pdserve_worker_saturated",
                  "remote prefills kept local because every prefill worker was at its limit (total)"),
    "kv_bytes_received": ("pdserve_worker_kv_bytes_received",
                          "prompt KV bytes prefill workers wrote into this worker (total)"),
    "kv_transfer_seconds": ("pdserve_worker_kv_transfer_seconds",
                            "prefill workers' time from KV computed to last write acknowledged (total)"),
    "kv_transfer_failures": ("pdserve_worker_kv_transfer_failures", "remote prefills that failed (total)"),
    "jobs": ("pdserve_worker_prefill_jobs", "remote prefills in flight on the prefill worker"),
    "tokens_computed": ("pdserve_worker_prefill_tokens_computed", "prompt tokens the prefill worker computed (total)"),
    "blocks_written": ("pdserve_worker_prefill_blocks_written",
                       "KV blocks the prefill worker wrote to decode workers (total)"),
    "prefills": ("pdserve_worker_prefills_done", "remote prefills whose KV was all written (total)"),
    "failed": ("pdserve_worker_prefills_failed", "remote prefills that failed on the prefill worker (total)"),
    "refused": ("pdserve_worker_prefills_refused", "remote prefills the prefill worker refused unstarted: they "
                "arrived past their deadline, from a decode worker no longer its peer, or named blocks that do "
                "not fit (total)"),
}
# These also carry the worker's KV transport and fabric (tcp, rdma, ...: kv_transfer/fabric.py)
# as labels: KV that crosses hosts over TCP where RDMA was meant is visible on the graph.
TRANSFER_GAUGES = ("kv_bytes_received", "kv_transfer_seconds", "kv_transfer_failures", "blocks_written")
PHASES = ("queue", "prefill", "transfer", "decode", "kv_write")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "request received to first token",
                              registry=r, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "time between tokens",
                             registry=r, buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds",
                              "(end-to-end - time to first token) / (output tokens - 1)",
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
        self.prompt_length = Histogram("pdserve_request_prompt_tokens", "prompt tokens per sequence routed",
                                       registry=r, buckets=PROMPT_LENGTH_BUCKETS)
        self.cached_tokens = Counter("pdserve_router_predicted_cached_tokens",
                                     "prompt tokens the routing policy expected to be cached", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "tokens generated", registry=r)
        self.prefix_cached_tokens = Counter("pdserve_prefix_cache_hit_tokens",
                                            "prompt tokens the decode worker found in its prefix cache",
                                            registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "requests the router is serving", registry=r)
        self.phase = Histogram("pdserve_request_phase_seconds", "time per request in each phase",
                               ["phase", "prefill"], registry=r, buckets=LATENCY_BUCKETS)
        self.failovers = Counter("pdserve_decode_failovers",
                                 "requests resubmitted to another decode worker after theirs was declared dead",
                                 registry=r)
        self.live_workers = Gauge("pdserve_decode_workers_live", "decode workers the router routes to",
                                  registry=r)
        self.prefill_live = Gauge("pdserve_prefill_workers_live", "prefill workers answering the router's pings",
                                  registry=r)
        self.worker_live = Gauge("pdserve_worker_live", "1 if the router considers the worker (decode or "
                                 "prefill) alive", ["worker", "role"], registry=r)
        self.worker = {key: Gauge(name, help_, ["worker", "role", *(("transport", "fabric") if key in TRANSFER_GAUGES
                                                                    else ())], registry=r)
                       for key, (name, help_) in WORKER_GAUGES.items()}
        self._links: dict[tuple[str, str], tuple[str, str]] = {}  # (worker, role) -> its transfer gauges' labels
        # Elastic pools (cluster/elastic.py) and their planner (cluster/autoscale/).
        self.pool_workers = Gauge("pdserve_pool_workers", "workers taking work in each pool (not draining)",
                                  ["role"], registry=r)
        self.scale_events = Counter("pdserve_scale_events", "workers added or removed at runtime",
                                    ["role", "action"], registry=r)
        self.autoscale_decisions = Counter("pdserve_autoscale_decisions",
                                           "the planner's decisions, by pool, action and reason",
                                           ["pool", "action", "reason"], registry=r)
        self.remote_prefill_min_tokens = Gauge("pdserve_remote_prefill_min_tokens",
                                               "uncached prompt tokens from which a prompt is prefilled remotely",
                                               registry=r)
        # SLO-aware admission (router/admission.py) and its predictor (router/predictor.py).
        self.admissions = Counter("pdserve_slo_admissions", "requests by SLO admission decision (admitted, "
                                  "rejected, degraded) and reason", ["decision", "reason"], registry=r)
        self.slo_requests = Counter("pdserve_slo_requests", "finished requests by API key and SLO outcome (met, "
                                    "missed, no_slo); goodput is the rate of met", ["key", "outcome"], registry=r)
        self.prediction_error = Histogram("pdserve_slo_prediction_error_seconds",
                                          "|actual - predicted| latency of each request, by target and placement",
                                          ["target", "prefill"], registry=r, buckets=LATENCY_BUCKETS)
        self.steps = WorkerHistograms()
        r.register(self.steps)
        self.spec_decode = WorkerSpecDecode()
        r.register(self.spec_decode)
        self.kv_tiers = WorkerKVTiers()
        r.register(self.kv_tiers)

    def observe_phases(self, phases: dict[str, float], remote: bool | None = None) -> None:
        """One finished request's phase times, labelled by where its prompt KV was
        computed, as its decode worker says (the router's plan may have changed there:
        saturation, fallback); None: a request with a transfer phase was remote."""
        if remote is None:
            remote = "transfer" in phases
        for name in PHASES:
            if name in phases:
                self.phase.labels(phase=name, prefill="remote" if remote else "local").observe(phases[name])

    def observe_prediction_error(self, target: str, remote: bool, error_s: float) -> None:
        self.prediction_error.labels(target=target, prefill="remote" if remote else "local").observe(error_s)

    def observe_tpot(self, e2e: float, ttft: float, num_tokens: int) -> None:
        """A finished request's time per output token; none for a single token."""
        if num_tokens > 1:
            self.tpot.observe((e2e - ttft) / (num_tokens - 1))

    def set_worker(self, name: str, role: str, stats: WorkerStats) -> None:
        """One worker's stats reply (role: "decode" or "prefill")."""
        link = (stats.kv_transport or "", stats.kv_fabric or "")
        if self._links.get((name, role), link) != link:  # restarted on another transport: its old series go
            self._forget_transfers(name, role)
        self._links[(name, role)] = link
        for field, gauge in self.worker.items():
            value = getattr(stats, field)
            if value is not None:  # None: a figure of the other role
                gauge.labels(name, role, *(link if field in TRANSFER_GAUGES else ())).set(value)
        self.steps.update(name, role, stats)
        self.spec_decode.update(name, role, stats)
        self.kv_tiers.update(name, role, stats)

    def forget_worker(self, name: str, role: str) -> None:
        """A worker scaled away: its labelled series leave /metrics (a restarted one
        keeps its name, so only a scale-down forgets)."""
        self._forget_transfers(name, role)
        self._links.pop((name, role), None)
        for gauge in [*(g for k, g in self.worker.items() if k not in TRANSFER_GAUGES), self.worker_live]:
            try:
                gauge.remove(name, role)
            except KeyError:  # it never reported that figure
                pass
        self.steps.forget(name, role)
        self.spec_decode.forget(name, role)
        self.kv_tiers.forget(name, role)

    def _forget_transfers(self, name: str, role: str) -> None:
        link = self._links.get((name, role))
        if link is None:
            return
        for key in TRANSFER_GAUGES:
            try:
                self.worker[key].remove(name, role, *link)
            except KeyError:  # a figure of the other role
                pass

    def set_live(self, decode: dict[str, bool], prefill: dict[str, bool]) -> None:
        """Each worker's health as the router sees it (router/health.py)."""
        for role, workers in (("decode", decode), ("prefill", prefill)):
            for name, ok in workers.items():
                self.worker_live.labels(worker=name, role=role).set(int(ok))
        self.live_workers.set(sum(decode.values()))
        self.prefill_live.set(sum(prefill.values()))

    def render(self) -> bytes:
        return generate_latest(self.registry)
