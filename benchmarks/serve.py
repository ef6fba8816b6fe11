"""Serving benchmark: a load generator against pdserve's HTTP endpoint.

    .venv/bin/python benchmarks/serve.py --config configs/local.yaml --rates 0.5,1 --duration 60
    .venv/bin/python benchmarks/serve.py --url http://127.0.0.1:8000/v1 --rates 1   # a running server

Requests arrive as a Poisson process at each --rates value (requests/s), for --duration
seconds each, with seeded prompt lengths U[--prompt-len] (random words) and output
lengths U[--output-len] (ignore_eos, so each produces exactly that many tokens); with
--shared-prefix N every prompt starts with the same N words. Each request is streamed,
and the definitions are vLLM's `bench serve` ones:
  TTFT  request sent -> first token received
  TPOT  (end-to-end - TTFT) / (output tokens - 1), per request
  ITL   time between consecutive streamed chunks (the router sends one per engine step)
  goodput  requests/s that met both SLOs (--slo-ttft, --slo-tpot)
A progress bar counts finished requests. It prints p50/p90/p99 of each, request and
token throughput, and writes JSON with --json. With --config it starts that cluster
itself (`pdserve serve`'s code) and stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package ships with
from tqdm import tqdm

# Run as a script, benchmarks/ heads sys.path, and its kv_transfer.py would shadow the
# kv_transfer package that the cluster imports (with PYTHONPATH set to the repo root,
# which then comes second): the repo root goes first instead.
_REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != _REPO_ROOT / "benchmarks"]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega block cache token prefill decode").split()


@dataclass
class Result:
    prompt_words: int
    output_tokens: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                      result: Result, extra: dict | None = None) -> None:
    """extra: more body fields (e.g. response_format). With stream_options.include_usage,
    result.output_tokens becomes the count the server reports (a grammar may end early)."""
    body = {"model": model, "prompt": prompt, "max_tokens": result.output_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, **(extra or {})}
    start = last = time.perf_counter()
    got = 0
    try:
        async with client.stream("POST", f"{url}/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                # The stream carries text; a chunk is one step's tokens for this request.
                got += 1
                if got == 1:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.e2e = time.perf_counter() - start
        result.ok = True
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"


async def run_rate(url: str, model: str, rate: float, duration: float, args: argparse.Namespace,
                   seed: int) -> tuple[list[Result], float]:
    rng = random.Random(seed)
    shared = [rng.choice(WORDS) for _ in range(args.shared_prefix)]
    schedule = []  # (arrival time, prompt, result), drawn before any request is sent
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            break
        words = rng.randint(*args.prompt_len)
        prompt = " ".join(shared + [rng.choice(WORDS) for _ in range(words)])
        schedule.append((t, prompt, Result(words + len(shared), rng.randint(*args.output_len))))
    tasks = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    with tqdm(total=len(schedule), desc=f"rate {rate}/s", unit="req", file=sys.stderr) as bar:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            start = time.perf_counter()
            for t, prompt, result in schedule:
                delay = start + t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(one_request(client, url, model, prompt, result))
                task.add_done_callback(lambda _: bar.update(1))
                tasks.append(task)
            await asyncio.gather(*tasks)
            elapsed = time.perf_counter() - start
    return [result for _, _, result in schedule], elapsed


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": qs[49], "p90": qs[89], "p99": qs[98]}


def summarize(results: list[Result], elapsed: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    good = [r for r in ok if r.ttft <= args.slo_ttft and (r.tpot or 0.0) <= args.slo_tpot]
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5], "seconds": elapsed,
        "request_throughput": len(ok) / elapsed, "output_throughput": sum(r.output_tokens for r in ok) / elapsed,
        "goodput": len(good) / elapsed,
        "ttft": percentiles([r.ttft for r in ok]), "tpot": percentiles(tpots),
        "itl": percentiles([x for r in ok for x in r.itl]), "e2e": percentiles([r.e2e for r in ok]),
    }


@contextmanager
def serving(config_path: str | None, url: str | None, model: str | None = None,
            port: int | None = None) -> Iterator[tuple[str, str]]:
    """(base URL, model name) of the server to load: with config_path, that cluster
    started here (`pdserve serve`'s code) and stopped on exit; else the one at url."""
    if config_path is None:
        url = url.rstrip("/")
        yield url, model or httpx.get(f"{url}/models").json()["data"][0]["id"]
        return
    import dataclasses
    import threading

    import uvicorn

    from cluster.config import load_cluster_config
    from cluster.serve import build
    from router.app import create_app

    config = load_cluster_config(config_path)
    if port is not None:
        config = dataclasses.replace(config, router=dataclasses.replace(config.router, port=port))
    workers, router = build(config)
    server = None
    try:
        server = uvicorn.Server(uvicorn.Config(create_app(router), host=config.router.host,
                                               port=config.router.port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        yield f"http://{config.router.host}:{config.router.port}/v1", model or config.model
    finally:
        if server is not None:
            server.should_exit = True
        workers.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", help="start this cluster config, benchmark it, stop it")
    where.add_argument("--url", help="a running server's base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="model name (default: the config's, or the server's)")
    p.add_argument("--rates", default="0.5,1", help="comma-separated request rates (requests/s)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[50, 400], metavar=("MIN", "MAX"),
                   help="prompt length in words (about 1-2 tokens each)")
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--shared-prefix", type=int, default=0, help="words every prompt starts with")
    p.add_argument("--slo-ttft", type=float, default=5.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.5, help="seconds per output token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=None, help="with --config: override router.port")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args()

    with serving(args.config, args.url, args.model, args.port) as (url, model):
        report = {"url": url, "model": model, "args": {k: v for k, v in vars(args).items()}, "rates": {}}
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            print(f"[rate {rate}/s] {args.duration:.0f} s of Poisson arrivals ...", file=sys.stderr, flush=True)
            results, elapsed = asyncio.run(run_rate(url, model, rate, args.duration, args, args.seed + i))
            s = report["rates"][rate] = summarize(results, elapsed, args)
            s["results"] = [asdict(r) | {"itl": None} for r in results]
            print(f"rate {rate}/s: {s['completed']}/{s['requests']} ok, {s['request_throughput']:.2f} req/s, "
                  f"{s['output_throughput']:.1f} output tok/s, goodput {s['goodput']:.2f} req/s | "
                  f"TTFT p50/p90/p99 {s['ttft']['p50']:.2f}/{s['ttft']['p90']:.2f}/{s['ttft']['p99']:.2f} s | "
                  f"TPOT {s['tpot']['p50'] * 1e3:.0f}/{s['tpot']['p90'] * 1e3:.0f}/{s['tpot']['p99'] * 1e3:.0f} ms | "
                  f"ITL {s['itl']['p50'] * 1e3:.0f}/{s['itl']['p90'] * 1e3:.0f}/{s['itl']['p99'] * 1e3:.0f} ms"
                  + (f" | errors: {s['errors']}" if s["errors"] else ""), flush=True)
        if args.json_path:
            Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json_path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
