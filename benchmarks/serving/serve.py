"""Serving benchmark: a load generator against pdserve's HTTP endpoint.

    .venv/bin/python -m benchmarks.serving serve --config configs/local.yaml --rates 0.5,1 --duration 60
    .venv/bin/python -m benchmarks.serving serve --url http://127.0.0.1:8000/v1 --rates 1   # a running server
    .venv/bin/python -m benchmarks.serving serve --config configs/local.yaml --concurrency 4 \
        --num-requests 200 --seeds 0,1,2 --prompt-tokens 500 900 --json results/x.json

Load, one run per seed and load point:
  --rates R1,R2       Poisson arrivals at each rate (requests/s), for --duration seconds,
                      or until --num-requests requests have arrived (open loop)
  --concurrency N1,N2 N requests outstanding at all times, --num-requests in all (closed loop)
Both may be given: the concurrency points run first, then the rates (default: rates 0.5,1).
Prompts are random words, U[--prompt-len] of them (with --shared-prefix N every prompt
starts with the same N words), or with --prompt-tokens MIN MAX that many random token
ids sent as the prompt itself; output lengths U[--output-len] (ignore_eos, so each
produces exactly that many tokens). Every length is drawn from the seed (seed + the load
point's index) before the first request, so two setups run with the same seeds see the
same requests. Each request is streamed, and the definitions are vLLM's `bench serve`:
  TTFT  request sent -> first token received
  TPOT  (end-to-end - TTFT) / (output tokens - 1), per request
  ITL   time between consecutive streamed chunks (the router sends one per engine step)
  goodput  requests/s that met both SLOs (--slo-ttft, --slo-tpot)
  KV transfer  per remote prefill, the router's pdserve_request_phase_seconds{phase=
        "kv_write"} (the prefill worker's KV computed -> last write acknowledged)
        scraped before and after the run: mean, and p50/p99 at its buckets' resolution;
        "hop" the same for phase="transfer" (also the trip to the prefill worker, its
        wait for the step it was in, and the notification back)
It prints p50/p90/p99 of each, request and token throughput, and writes JSON with
--json (its "runs"; benchmarks/serving/serve_compare.py reads two of them; null for a value with
no data, e.g. the KV transfer of a run without remote prefill). With --config it
starts that cluster itself (`pdserve serve`'s code) and stops it. $PDSERVE_API_KEY, if
set, goes with every request as a bearer key.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path

# Run as a file, this script's folder heads sys.path, where a module could shadow a
# package or the standard library (elastic/trace.py: `trace`): the repo root goes first.
_REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.serving.load import WORDS, Result, Workload, auth_headers, one_request, run_concurrency, run_poisson  # noqa: E402
from benchmarks.serving.metrics_scrape import KV_HOP, KV_WRITE, scrape, transfer_delta  # noqa: E402
from benchmarks.serving.report import json_text, line, percentiles, summarize  # noqa: E402
from benchmarks.serving.server import ServerError, serving  # noqa: E402

__all__ = ["WORDS", "Result", "one_request", "percentiles", "run_load", "serving", "summarize"]


def numbers(text: str, kind: type[int] | type[float], option: str, lowest: float | None = 0) -> list:
    """A comma-separated list of distinct numbers, each > lowest (None: any); ValueError
    naming the option and the bad item."""
    out = []
    for item in text.split(","):
        if not item.strip():
            raise ValueError(f"{option}: {text!r} has an empty item")
        try:
            value = kind(item.strip())
        except ValueError:
            what = "whole number" if kind is int else "number"
            raise ValueError(f"{option}: {item.strip()!r} in {text!r} is not a {what}") from None
        if not math.isfinite(value):
            raise ValueError(f"{option}: {item.strip()} is not a finite number")
        if lowest is not None and value <= lowest:
            raise ValueError(f"{option}: {item.strip()} must be > {lowest}")
        if value in out:
            raise ValueError(f"{option}: {item.strip()} is given twice in {text!r}")
        out.append(value)
    return out


def run_load(url: str, model: str, workload: Workload, seed: int, index: int = 0, *,
             rate: float | None = None, concurrency: int | None = None, num_requests: int | None = None, duration: float = 60.0,
             slo: tuple[float, float] = (5.0, 0.5), api_key: str | None = None) -> dict:
    """One run at one load point (a Poisson rate or a concurrency): its summary, the KV
    transfer time per request from the router's metrics, and every request's result.
    Requests are drawn from seed + index (index: the load point's place in the command)."""
    label = f"seed {seed} " + (f"rate {rate}/s" if rate is not None else f"concurrency {concurrency}")
    schedule = workload.draw(num_requests, seed + index, rate, duration)
    before = scrape(url, auth_headers(api_key))
    if rate is not None:
        results, elapsed = asyncio.run(run_poisson(url, model, schedule, label, api_key))
    else:
        results, elapsed = asyncio.run(run_concurrency(url, model, schedule, concurrency, label, api_key))
    s = summarize(results, elapsed, *slo)
    after = scrape(url, auth_headers(api_key))
    s["kv_transfer"], s["kv_hop"] = transfer_delta(before, after, KV_WRITE), transfer_delta(before, after, KV_HOP)
    print(line(label, s), flush=True)
    load = {"load": "poisson", "rate": rate} if rate is not None else {"load": "concurrency",
                                                                       "concurrency": concurrency}
    return {"seed": seed, **load, **s, "results": [asdict(r) | {"itl": None} for r in results]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="serve.py", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", help="start this cluster config, benchmark it, stop it")
    where.add_argument("--url", help="a running server's base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="model name (default: the config's, or the server's)")
    p.add_argument("--rates", default=None,
                   help="comma-separated Poisson request rates (requests/s); default 0.5,1 unless --concurrency")
    p.add_argument("--concurrency", default=None,
                   help="comma-separated counts of requests kept outstanding (run before any --rates)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of Poisson arrivals per rate")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per run (Poisson: instead of --duration; required with --concurrency)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[50, 400], metavar=("MIN", "MAX"),
                   help="prompt length in words (about 1-2 tokens each)")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="prompts of this many random token ids instead of words")
    p.add_argument("--token-ids", type=int, nargs=2, default=[1000, 30000], metavar=("LOW", "HIGH"),
                   help="with --prompt-tokens: ids drawn from [LOW, HIGH), inside the model's vocabulary")
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--shared-prefix", type=int, default=0, help="words every prompt starts with")
    p.add_argument("--slo-ttft", type=float, default=5.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.5, help="seconds per output token")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=None, help="one seed (as --seeds N)")
    seeds.add_argument("--seeds", default="0", help="comma-separated seeds: a run of every load point each")
    p.add_argument("--port", type=int, default=None, help="with --config: override router.port")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    try:
        args.seeds = [args.seed] if args.seed is not None else numbers(args.seeds, int, "--seeds", lowest=None)
        if args.concurrency is not None:
            numbers(args.concurrency, int, "--concurrency")
        if args.rates is not None:
            numbers(args.rates, float, "--rates")
    except ValueError as exc:
        p.error(str(exc))
    if args.rates is None and args.concurrency is None:
        args.rates = "0.5,1"
    if args.concurrency is not None and args.num_requests is None:
        p.error("--concurrency needs --num-requests (the closed loop's stop)")
    if args.num_requests is not None and args.num_requests < 1:
        p.error(f"--num-requests must be >= 1, got {args.num_requests}")
    for option, value in (("--duration", args.duration), ("--slo-ttft", args.slo_ttft), ("--slo-tpot", args.slo_tpot)):
        if not (math.isfinite(value) and value > 0):
            p.error(f"{option} must be a number of seconds > 0, got {value}")
    if args.shared_prefix < 0:
        p.error(f"--shared-prefix must be >= 0, got {args.shared_prefix}")
    # Without a shared prefix a prompt of 0 words would be empty.
    ranges = [("--prompt-len", args.prompt_len, 0 if args.shared_prefix else 1), ("--output-len", args.output_len, 1)]
    if args.prompt_tokens is not None:
        ranges.append(("--prompt-tokens", args.prompt_tokens, 1))
    for option, (lo, hi), least in ranges:
        if not least <= lo <= hi:
            p.error(f"{option} needs {least} <= MIN <= MAX, got {lo} {hi}")
    if not 0 <= args.token_ids[0] < args.token_ids[1]:
        p.error(f"--token-ids needs 0 <= LOW < HIGH, got {args.token_ids}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    api_key = os.environ.get("PDSERVE_API_KEY") or None
    workload = Workload(tuple(args.prompt_len), tuple(args.output_len), args.shared_prefix,
                        tuple(args.prompt_tokens) if args.prompt_tokens else None, tuple(args.token_ids))
    points = [{"concurrency": c} for c in numbers(args.concurrency, int, "--concurrency")] if args.concurrency else []
    points += [{"rate": r} for r in numbers(args.rates, float, "--rates")] if args.rates else []
    try:
        with serving(args.config, args.url, args.model, args.port, api_key) as (url, model):
            report = {"url": url, "model": model, "args": vars(args), "runs": []}
            for seed in args.seeds:
                for i, point in enumerate(points):
                    report["runs"].append(run_load(url, model, workload, seed, i, **point,
                                                   num_requests=args.num_requests, duration=args.duration,
                                                   slo=(args.slo_ttft, args.slo_tpot), api_key=api_key))
    except ServerError as exc:
        sys.exit(f"serve.py: error: {exc}")
    if len(args.seeds) == 1 and args.concurrency is None:  # the format before "runs"
        report["rates"] = {run["rate"]: run for run in report["runs"]}
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json_text(report))


if __name__ == "__main__":
    main()
