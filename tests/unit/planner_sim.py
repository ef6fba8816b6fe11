"""A deployment in figures only, for the planner's tests: an offered load (requests/s,
prompt and output lengths) served by pools of fixed per-worker capacity, with latency
and queues that grow with each pool's utilisation, reported as the LoadSnapshots the
router would take. No process, no clock: each advance() moves time on by its seconds.

    decode utilisation  u_d = (generated tokens/s + local prompt tokens/s / 50) / (workers * DECODE_CAPACITY)
    prefill utilisation u_p = remote prompt tokens/s / (workers * PREFILL_CAPACITY)
    TPOT = 0.05 s / (1 - u_d),  TTFT = 0.2 s / (1 - u_p)   (u capped at 0.95)

A prompt goes remote with probability base_min_tokens / remote_prefill_min_tokens (the
threshold's effect on a spread of prompt lengths), else its decode worker prefills it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from cluster.autoscale.planner import Decision, Planner
from router.load import LoadSnapshot, WorkerLoad
from router.metrics import LATENCY_BUCKETS, PROMPT_LENGTH_BUCKETS

DECODE_CAPACITY = 100.0  # generated tokens/s per decode worker
PREFILL_CAPACITY = 1000.0  # prompt tokens/s per prefill worker
BOUNDS = (*LATENCY_BUCKETS, float("inf"))


@dataclass
class Histogram:
    bounds: tuple[float, ...] = BOUNDS
    counts: list[float] = field(default_factory=list)

    def observe(self, value: float, n: float) -> None:
        self.counts = self.counts or [0.0] * len(self.bounds)
        for i, le in enumerate(self.bounds):
            if value <= le:
                self.counts[i] += n
                return

    def buckets(self) -> tuple[tuple[float, float], ...]:
        out, total = [], 0.0
        for le, n in zip(self.bounds, self.counts or [0.0] * len(self.bounds)):
            total += n
            out.append((le, total))
        return tuple(out)


@dataclass
class Load:
    rps: float
    prompt_len: int = 100
    output_len: int = 100


@dataclass
class Sim:
    prefill: int = 1
    decode: int = 1
    min_tokens: int = 64
    base_min_tokens: int = 64
    at: float = 1000.0  # a monotonic clock's value, not 0
    requests: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    prompt_lengths: Histogram = field(default_factory=lambda: Histogram((*PROMPT_LENGTH_BUCKETS, float("inf"))))
    computed: dict[str, float] = field(default_factory=dict)  # per prefill worker, cumulative
    mute: set[str] = field(default_factory=set)  # workers whose stats reply does not come
    figures: dict[str, float] = field(default_factory=dict)  # the last advance's latencies and utilisations

    @property
    def sizes(self) -> dict[str, int]:
        return {"prefill": self.prefill, "decode": self.decode}

    def advance(self, seconds: float, load: Load) -> LoadSnapshot:
        remote_share = min(1.0, self.base_min_tokens / self.min_tokens) if self.prefill else 0.0
        prompt_rate, gen_rate = load.rps * load.prompt_len, load.rps * load.output_len
        u_d = (gen_rate + prompt_rate * (1 - remote_share) / 50) / (self.decode * DECODE_CAPACITY)
        u_p = prompt_rate * remote_share / (self.prefill * PREFILL_CAPACITY) if self.prefill else 0.0
        tpot, ttft = 0.05 / (1 - min(u_d, 0.95)), 0.2 / (1 - min(u_p, 0.95))
        n = load.rps * seconds
        self.at += seconds
        self.requests += n
        self.prompt_tokens += n * load.prompt_len
        self.generation_tokens += n * load.output_len
        if n:
            self.ttft.observe(ttft, n)
            self.tpot.observe(tpot, n)
            self.itl.observe(tpot, n * max(load.output_len - 1, 0))
            self.prompt_lengths.observe(load.prompt_len, n)
        # Each prefill worker computes its share of the remote prompts, up to its capacity.
        per_worker = min(prompt_rate * remote_share / self.prefill, PREFILL_CAPACITY) if self.prefill else 0.0
        for i in range(self.prefill):
            self.computed[f"prefill-{i}"] = self.computed.get(f"prefill-{i}", 0.0) + per_worker * seconds
        self.figures = {"u_d": u_d, "u_p": u_p, "tpot": tpot, "ttft": ttft}
        jobs = round(4 * u_p)  # per prefill worker
        workers = [self._worker(f"decode-{i}", "decode", kv_used=min(1.0, 0.8 * u_d),
                                waiting=max(0, round((u_d - 1) * 10)),
                                waiting_for_kv=jobs * self.prefill // self.decode) for i in range(self.decode)]
        workers += [self._worker(f"prefill-{i}", "prefill", jobs=jobs,
                                 tokens_computed=round(self.computed[f"prefill-{i}"])) for i in range(self.prefill)]
        in_flight = round(load.rps * (ttft + load.output_len * tpot))
        return LoadSnapshot(self.at, self.requests, self.requests, self.prompt_tokens, self.generation_tokens,
                            in_flight, self.ttft.buckets(), self.tpot.buckets(), self.min_tokens, tuple(workers),
                            self.itl.buckets(), self.prompt_lengths.buckets())

    def _worker(self, name: str, role: str, **figures: float) -> WorkerLoad:
        if name in self.mute:
            return WorkerLoad(name, role, live=True, draining=False, answered=False)
        return WorkerLoad(name, role, live=True, draining=False, answered=True,
                          **figures)  # type: ignore[arg-type]  # the float fields, by name

    def apply(self, decision: Decision) -> None:
        if decision.pool == "router":
            self.min_tokens = decision.target
        else:
            setattr(self, decision.pool, decision.target)


@dataclass(frozen=True)
class Step:
    at: float
    decision: Decision
    figures: dict[str, float]  # the sim's figures in the window that led to it


def drive(planner: Planner, sim: Sim, phases: list[tuple[float, Load]]) -> list[Step]:
    """Look every interval_s through the phases (seconds, load), as PlannerLoop does,
    applying each decision at once; every decision taken, in order."""
    interval, window = planner.config.interval_s, planner.config.window_s
    history: list[LoadSnapshot] = [sim.advance(0.0, Load(0.0))]
    steps: list[Step] = []
    for seconds, load in phases:
        for _ in range(round(seconds / interval)):
            new = sim.advance(interval, load)
            history.append(new)
            old = [s for s in history if s.at <= new.at - window][-1:] or history[:1]
            for decision in planner.decide(old[0], new, dict(sim.sizes), new.at):
                assert dataclasses.is_dataclass(decision)
                sim.apply(decision)
                steps.append(Step(new.at, decision, dict(sim.figures)))
    return steps
