"""Requests and the two ways of sending them: Poisson arrivals (open loop) and a fixed
number outstanding (closed loop). Every prompt and output length is drawn from the
seed before the first request goes out, so two setups given the same seed see the same
requests in the same order."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx2 as httpx  # the HTTP client the openai package ships with
from tqdm import tqdm

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega block cache token prefill decode").split()


@dataclass
class Result:
    prompt_words: int  # prompt length in words (text prompts) or tokens (token-id prompts)
    output_tokens: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass(frozen=True)
class Workload:
    """How prompts are drawn: `prompt_len` words of WORDS (with `shared_prefix` words
    every prompt starts with), or, with prompt_tokens, that many token ids drawn from
    [token_ids[0], token_ids[1]) sent as the prompt itself (no tokenizer in between, so
    the length is exact)."""
    prompt_len: tuple[int, int] = (50, 400)
    output_len: tuple[int, int] = (16, 128)
    shared_prefix: int = 0
    prompt_tokens: tuple[int, int] | None = None
    token_ids: tuple[int, int] = (1000, 30000)

    def draw(self, n: int | None, seed: int, rate: float | None = None,
             duration: float | None = None) -> list[tuple[float, str | list[int], Result]]:
        """(arrival time, prompt, result) per request: n of them, or with n None as many
        as Poisson arrivals at `rate` bring within `duration` seconds. Arrival times are 0
        without a rate (closed loop)."""
        rng = random.Random(seed)
        shared = [rng.choice(WORDS) for _ in range(self.shared_prefix)]
        out, t = [], 0.0
        while n is None or len(out) < n:
            if rate is not None:
                t += rng.expovariate(rate)
                if n is None and t > duration:
                    break
            if self.prompt_tokens is not None:
                length = rng.randint(*self.prompt_tokens)
                prompt: str | list[int] = [rng.randrange(*self.token_ids) for _ in range(length)]
            else:
                length = rng.randint(*self.prompt_len)
                prompt = " ".join(shared + [rng.choice(WORDS) for _ in range(length)])
                length += len(shared)
            out.append((t, prompt, Result(length, rng.randint(*self.output_len))))
        return out


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str | list[int],
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
                if chunk.get("error"):  # the router's event for a stream broken after its headers
                    result.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                    return
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


def _client(api_key: str | None) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, headers=auth_headers(api_key))


async def run_poisson(url: str, model: str, schedule: list[tuple[float, str | list[int], Result]],
                      label: str, api_key: str | None = None) -> tuple[list[Result], float]:
    """Send each request at its arrival time, whatever is still in flight (open loop);
    returns the results and the seconds from the first arrival to the last answer."""
    tasks = []
    with tqdm(total=len(schedule), desc=label, unit="req", file=sys.stderr) as bar:
        async with _client(api_key) as client:
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


async def run_concurrency(url: str, model: str, schedule: list[tuple[float, str | list[int], Result]],
                          concurrency: int, label: str,
                          api_key: str | None = None) -> tuple[list[Result], float]:
    """Keep `concurrency` requests outstanding (closed loop): each answer sends the next
    one, in the schedule's order, until the schedule is used up. Returns the results and
    the seconds from the first request to the last answer."""
    queue = iter(schedule)
    with tqdm(total=len(schedule), desc=label, unit="req", file=sys.stderr) as bar:
        async with _client(api_key) as client:
            start = time.perf_counter()

            async def sender() -> None:
                for _, prompt, result in queue:  # one shared iterator: each request goes out once
                    await one_request(client, url, model, prompt, result)
                    bar.update(1)

            await asyncio.gather(*(sender() for _ in range(concurrency)))
            elapsed = time.perf_counter() - start
    return [result for _, _, result in schedule], elapsed
