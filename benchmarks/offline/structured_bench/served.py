"""Served throughput: the real service (a cluster config, e.g. configs/local.yaml) under
two workloads of the same prompts and max_tokens, one with a json_schema response_format
on every other request and one with none; rounds alternate the two (and which goes
first), each round a burst of all its requests at once. Uses benchmarks/serving/serve.py's
request and percentile code."""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from typing import Any

import httpx2 as httpx

from benchmarks.offline.structured_bench.schema import SCHEMA
from benchmarks.offline.structured_bench.stats import Stat, ratios
from benchmarks.serving.serve import WORDS, Result, one_request, percentiles, serving

RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
USAGE = {"stream_options": {"include_usage": True}}


def workload(n: int, words: tuple[int, int], seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(n)]


async def burst(url: str, model: str, prompts: list[str], max_tokens: int, json_share: float,
                tag: str) -> dict[str, Any]:
    """Every request at once; a json_share of them (evenly interleaved) with the schema.
    Each prompt starts with `tag`, unique per run, so that no run reads an earlier run's
    prompts from the prefix cache (each pays its prefill, as the first did)."""
    prompts = [f"{tag} {p}" for p in prompts]
    results = [Result(0, max_tokens) for _ in prompts]
    every = round(1 / json_share) if json_share else 0
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(
            one_request(client, url, model, p, r,
                        {**USAGE, "response_format": RESPONSE_FORMAT} if every and i % every == 0 else USAGE)
            for i, (p, r) in enumerate(zip(prompts, results))))
        elapsed = time.perf_counter() - start
    failed = [r.error for r in results if not r.ok]
    return {"failed": len(failed), "error": failed[0] if failed else "", "seconds": elapsed, "requests_s": len(results) / elapsed,
            "tokens_s": sum(r.output_tokens for r in results) / elapsed,
            "output_tokens": sum(r.output_tokens for r in results),
            "e2e": percentiles([r.e2e for r in results if r.ok]),
            "ttft": percentiles([r.ttft for r in results if r.ok])}


def served(config: str, port: int | None, requests: int, words: tuple[int, int], max_tokens: int,
           rounds: int, json_share: float) -> dict[str, Any]:
    prompts = workload(requests, words, seed=0)
    kinds = {"none": 0.0, f"{json_share:.0%} json_schema": json_share}
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    with serving(config, None, None, port) as (url, model):
        for share in kinds.values():  # warm-up; the first schema request compiles it on the decode worker
            asyncio.run(burst(url, model, prompts[:4], 4, share, f"warm{share}"))
        for r in range(rounds):
            order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
            for kind in order:
                run = asyncio.run(burst(url, model, prompts, max_tokens, kinds[kind], f"run{r}{kind[0]}"))
                runs[kind].append(run)
                print(f"[served] round {r + 1} {kind}: {run['requests_s']:.2f} req/s, {run['tokens_s']:.1f} "
                      f"tok/s, {run['output_tokens']} tokens, {run['failed']} failed {run['error'][:160]}",
                      file=sys.stderr, flush=True)
    base, test = list(kinds)
    # A round where any request failed (an overloaded worker declared dead) is left out
    # of the figures, both its runs, so the pairs stay pairs; the count is reported.
    clean = [i for i in range(rounds) if not (runs[base][i]["failed"] or runs[test][i]["failed"])]
    if not clean:
        raise RuntimeError(f"every round had failed requests, e.g. {runs[base][0]['error'] or runs[test][0]['error']}")
    all_runs, runs = runs, {kind: [runs[kind][i] for i in clean] for kind in kinds}
    out: dict[str, Any] = {"requests": requests, "words": words, "max_tokens": max_tokens, "rounds": len(clean),
                           "rounds_left_out": rounds - len(clean), "kinds": list(kinds), "runs": all_runs}
    for key in ("requests_s", "tokens_s"):
        out[key] = {kind: Stat([run[key] for run in runs[kind]]) for kind in kinds}
        out[key + "_ratio"] = ratios([run[key] for run in runs[test]], [run[key] for run in runs[base]])
    for key in ("p50", "p99"):
        out["e2e_" + key] = {kind: Stat([run["e2e"][key] for run in runs[kind]]) for kind in kinds}
        out["e2e_" + key + "_ratio"] = ratios([run["e2e"][key] for run in runs[test]],
                                              [run["e2e"][key] for run in runs[base]])
    out["output_tokens"] = {kind: statistics.median(run["output_tokens"] for run in runs[kind]) for kind in kinds}
    return out


def print_served(r: dict[str, Any]) -> None:
    base, test = r["kinds"]
    print(f"\n### Served, {r['requests']} requests at once per run, prompts of {r['words'][0]}-{r['words'][1]} "
          f"words, max_tokens {r['max_tokens']} (median of {r['rounds']} runs each, min-max in brackets; "
          f"{r['rounds_left_out']} round(s) with failed requests left out)\n")
    print(f"| metric | {base} | {test} | {test} / {base} (paired by round) |\n|---|---:|---:|---:|")
    rows = [("requests/s", "requests_s", 1, 3), ("output tokens/s", "tokens_s", 1, 1),
            ("latency p50, s", "e2e_p50", 1, 2), ("latency p99, s", "e2e_p99", 1, 2)]
    for name, key, scale, digits in rows:
        print(f"| {name} | {r[key][base].show(scale, digits)} | {r[key][test].show(scale, digits)} | "
              f"{r[key + '_ratio'].show(1, 3)} |")
    print(f"| output tokens per run | {r['output_tokens'][base]:.0f} | {r['output_tokens'][test]:.0f} | |")
