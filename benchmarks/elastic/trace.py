"""The load trace: phases played one after the other, each with its own rate and request
shape, drawn from a seed before the first request goes out, so that every arm sees the
same requests at the same times (benchmarks/serving/load.py draws each phase's requests)."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.serving.load import Result, Workload

# Requests/s of each phase at --scale 1, for the demo model on one CPU thread per worker
# on a quiet 2-core machine (docs/benchmarks/2026-12-02-elastic-pools.md): prefill-heavy a little
# beyond what one prefill worker computes, decode-heavy beyond what one decode worker
# serves within the TPOT SLO and within what two do, idle a request now and then.
PREFILL_RATE = 0.7
DECODE_RATE = 1.6
IDLE_RATE = 0.1


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    rate: float  # requests/s: rate * seconds of them, at Poisson arrival times
    prompt_tokens: tuple[int, int]  # random token ids, U[lo, hi] of them
    output_len: tuple[int, int]  # max_tokens, U[lo, hi] (ignore_eos: exactly that many)


def three_phases(phase_s: float, scale: float) -> list[Phase]:
    """Prefill-heavy (long prompts, a few output tokens), decode-heavy (prompts short
    enough that the decode workers prefill them locally, long outputs), idle; `scale`
    multiplies every rate."""
    if not phase_s > 0:
        raise ValueError(f"--phase-s must be > 0 seconds, got {phase_s}")
    if not scale > 0:
        raise ValueError(f"--scale must be > 0, got {scale}")
    return [Phase("prefill-heavy", phase_s, PREFILL_RATE * scale, (400, 800), (4, 8)),
            Phase("decode-heavy", phase_s, DECODE_RATE * scale, (16, 48), (64, 128)),
            Phase("idle", phase_s, IDLE_RATE * scale, (16, 48), (8, 16))]


@dataclass
class Trace:
    phases: list[Phase]
    seed: int
    # (arrival time from the trace's start, prompt token ids, its result to fill), in time order
    schedule: list[tuple[float, list[int], Result]]
    phase_of: list[str]  # the phase each request of schedule arrived in

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    def starts(self) -> list[float]:
        """Each phase's start, seconds from the trace's start."""
        out, t = [], 0.0
        for p in self.phases:
            out.append(t)
            t += p.seconds
        return out

    def describe(self) -> dict:
        return {"seed": self.seed, "seconds": self.seconds, "requests": len(self.schedule),
                "phases": [asdict(p) | {"requests": self.phase_of.count(p.name)} for p in self.phases]}


def draw_trace(phases: list[Phase], seed: int, token_ids: tuple[int, int]) -> Trace:
    """The trace's requests: phase i's drawn from seed * 100 + i. Each phase has exactly
    round(rate * seconds) requests, at the times of a Poisson process given that count
    (uniform, sorted), so that the seeds of the repeats differ in when and what, not in
    how much: with tens of requests a phase, a free count varies by +-25%."""
    schedule: list[tuple[float, list[int], Result]] = []
    phase_of: list[str] = []
    start = 0.0
    for i, phase in enumerate(phases):
        workload = Workload(output_len=phase.output_len, prompt_tokens=phase.prompt_tokens, token_ids=token_ids)
        count = round(phase.rate * phase.seconds)
        rng = random.Random(seed * 100 + i)
        times = sorted(rng.uniform(0.0, phase.seconds) for _ in range(count))
        for t, (_, prompt, result) in zip(times, workload.draw(count, seed * 100 + i)):
            assert isinstance(prompt, list)  # prompt_tokens set: token ids, never text
            schedule.append((start + t, prompt, result))
            phase_of.append(phase.name)
        start += phase.seconds
    return Trace(phases, seed, schedule, phase_of)


def model_token_ids(model_dir: str) -> tuple[int, int]:
    """Token ids to draw prompts from: [1000, 30000) as benchmarks/serving/serve.py draws them,
    cut to the model's vocabulary (a tiny test model has a few hundred)."""
    config = Path(model_dir) / "config.json"
    try:
        vocab = int(json.loads(config.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read the vocabulary size from {config}: {exc}") from None
    return (min(1000, vocab // 8), min(30000, vocab))
