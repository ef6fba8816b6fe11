"""The load trace: phases played one after the other, each with its own Poisson rate and
request shape, drawn from a seed before the first request goes out, so that every arm
sees the same requests at the same times (benchmarks/serving/load.py draws each phase)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.serving.load import Result, Workload

# Requests/s of each phase at --scale 1, for the demo model on one CPU thread per worker
# (docs/benchmarks.md, "Elastic pools"): prefill-heavy at about 1.5x what one prefill
# worker computes, decode-heavy at a batch that one decode worker runs well above the
# TPOT SLO and two run within it, idle a request now and then.
PREFILL_RATE = 0.6
DECODE_RATE = 1.2
IDLE_RATE = 0.1


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    rate: float  # Poisson arrivals, requests/s
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
    """The trace's requests: phase i's drawn from seed * 100 + i, shifted to its start."""
    schedule: list[tuple[float, list[int], Result]] = []
    phase_of: list[str] = []
    start = 0.0
    for i, phase in enumerate(phases):
        workload = Workload(output_len=phase.output_len, prompt_tokens=phase.prompt_tokens, token_ids=token_ids)
        for t, prompt, result in workload.draw(None, seed * 100 + i, phase.rate, phase.seconds):
            assert isinstance(prompt, list)  # prompt_tokens set: token ids, never text
            schedule.append((start + t, prompt, result))
            phase_of.append(phase.name)
        start += phase.seconds
    return Trace(phases, seed, schedule, phase_of)


def model_token_ids(model_dir: str) -> tuple[int, int]:
    """Token ids to draw prompts from: [1000, 30000) as benchmarks/serve.py draws them,
    cut to the model's vocabulary (a tiny test model has a few hundred)."""
    config = Path(model_dir) / "config.json"
    try:
        vocab = int(json.loads(config.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read the vocabulary size from {config}: {exc}") from None
    return (min(1000, vocab // 8), min(30000, vocab))
