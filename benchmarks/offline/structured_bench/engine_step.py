"""A real decode step of the engine with 0% vs 100% constrained rows: two EngineCores
with `batch` requests each in decode, the same prompts, greedy, stepped alternately;
each constrained step against the plain step beside it is the paired figure."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import xgrammar as xgr

from benchmarks.offline.structured_bench.stats import Stat, ratios
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.sampling.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.structured.matcher import GrammarState
from engine.structured.params import StructuredOutputsParams


def prompts_for(batch: int, length: int) -> list[list[int]]:
    return [[(i * 7919 + j * 104729) % 20000 + 100 for j in range(length)] for i in range(batch)]


def _start(core: EngineCore, tag: str, prompts: list[list[int]], params: SamplingParams) -> list[Any]:
    """Add the requests and step until every one is decoding (prefill, the grammar's compile)."""
    requests = [core.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    while not all(r.num_output_tokens for r in requests):
        core.step()
    return requests


def _stop(core: EngineCore, requests: list[Any]) -> None:
    done = [r.request_id for r in requests if r.status.finished]
    if done:
        raise RuntimeError(f"{len(done)} requests finished inside the timed steps; the batch shrank "
                           "(a grammar ended early): use fewer --engine-steps")
    core.abort([r.request_id for r in requests])
    while core.has_unfinished():
        core.step()


def _timed_step(core: EngineCore) -> float:
    start = time.perf_counter()
    core.step()
    return time.perf_counter() - start


def _paired_round(cores: list[EngineCore], tag: str, prompts: list[list[int]], params: list[SamplingParams],
                  steps: int) -> list[list[float]]:
    """cores[k] runs params[k]'s requests; their decode steps alternate (A B, then B A),
    so each pair of steps sees the same moment of the machine. Seconds per step, per core."""
    requests = [_start(core, f"{tag}-{k}", prompts, p) for k, (core, p) in enumerate(zip(cores, params))]
    seconds: list[list[float]] = [[], []]
    for n in range(steps):
        for k in ((0, 1) if n % 2 == 0 else (1, 0)):
            seconds[k].append(_timed_step(cores[k]))
    for core, reqs in zip(cores, requests):
        _stop(core, reqs)
    return seconds


@contextmanager
def _timed(owner: Any, name: str, totals: dict[str, float], key: str) -> Iterator[None]:
    """Adds the seconds spent in owner.name to totals[key] while the block runs."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _profile(core: EngineCore, tag: str, prompts: list[list[int]], params: SamplingParams,
             steps: int) -> dict[str, float]:
    """ms per decode step spent in each part (one round with timing wrappers around the
    parts; the wrappers add a little to each)."""
    totals: dict[str, float] = {}
    parts = [(Sampler, "sample", "sampler.sample (all)"), (GrammarState, "fill", "  mask fill"),
             (xgr, "apply_token_bitmask_inplace", "  mask apply"), (GrammarState, "accept", "matcher accept"),
             (core.runner, "forward", "model forward")]
    requests = _start(core, tag, prompts, params)
    with ExitStack() as stack:
        for owner, name, key in parts:
            stack.enter_context(_timed(owner, name, totals, key))
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        totals["step"] = time.perf_counter() - start
    _stop(core, requests)
    return {key: seconds * 1e3 / steps for key, seconds in totals.items()}


def engine_steps(model: str, batch: int, prompt_len: int, steps: int, rounds: int, threads: int,
                 structured: StructuredOutputsParams) -> dict[str, Any]:
    """Two identical engines in lockstep, one decoding `batch` plain requests and the
    other the same prompts constrained; they swap kinds every round. The ratio is the
    median over step pairs of constrained / plain."""
    config = EngineConfig.from_options(model, num_threads=threads, max_num_seqs=max(batch, 1),
                                       kv_cache_memory_gib=1.0)
    cores = [EngineCore(config), EngineCore(config)]
    try:
        prompts = prompts_for(batch, prompt_len)
        plain = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
        constrained = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True,
                                     structured_outputs=structured)
        # Warm-up: each engine's first constrained request builds its tokenizer info and compiles.
        _paired_round(cores, "warm-a", prompts, [plain, constrained], 2)
        _paired_round(cores, "warm-b", prompts, [constrained, plain], 2)
        every: dict[str, list[float]] = {"plain": [], "constrained": []}
        for r in range(rounds):
            swap = r % 2 == 1
            seconds = _paired_round(cores, f"round-{r}", prompts,
                                    [constrained, plain] if swap else [plain, constrained], steps)
            every["plain"] += seconds[1 if swap else 0]
            every["constrained"] += seconds[0 if swap else 1]
        profile = {"plain": _profile(cores[0], "profile-plain", prompts, plain, steps),
                   "constrained": _profile(cores[0], "profile-constrained", prompts, constrained, steps)}
    finally:
        for core in cores:
            core.close()
    return {"batch": batch, "prompt_len": prompt_len, "steps": steps, "rounds": rounds, "threads": threads,
            "plain": Stat(every["plain"]), "constrained": Stat(every["constrained"]),
            "ratio": ratios(every["constrained"], every["plain"]), "profile": profile}


def print_engine(result: dict[str, Any]) -> None:
    r = result
    print(f"\n### Decode step, batch {r['batch']}, 0% vs 100% constrained rows (ms per step: median of "
          f"{r['rounds']} rounds x {r['steps']} steps, min-max in brackets)\n")
    print("| plain | constrained | constrained / plain (paired by step) |\n|---:|---:|---:|")
    print(f"| {r['plain'].show(1e3, 1)} | {r['constrained'].show(1e3, 1)} | {r['ratio'].show(1, 3)} |")
    print(f"\nWhere a step's time goes (ms per step, one profiled round of {r['steps']} steps each):\n")
    keys = list(dict.fromkeys(k for kind in ("plain", "constrained") for k in r["profile"][kind]))
    print("| part | plain | constrained |\n|---|---:|---:|")
    for key in keys:
        cells = [f"{r['profile'][kind][key]:.2f}" if key in r["profile"][kind] else "-"
                 for kind in ("plain", "constrained")]
        print(f"| {key} | " + " | ".join(cells) + " |")
