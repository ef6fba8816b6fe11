"""The scale fuzzer: a seeded schedule of scale events (random targets for both pools,
random drain timeouts, from none to enough; those past max_workers must be refused
with nothing changed) on a live local deployment, while seeded
greedy requests (random token-id prompts, long enough to go to the prefill pool or
not, random lengths, sometimes n=2) stream over HTTP. Every request must finish whole,
with the text of its tokens alone in the colocated oracle engine: a scale event may
move a request, never fail or change it."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import openai

from cluster.elastic import ScaleError
from engine.detokenizer import Detokenizer
from engine.sampling_params import SamplingParams
from tests.fuzz.common import VOCAB, Oracle


@dataclass
class ScaleRun:
    seed: int
    events: list[dict[str, Any]] = field(default_factory=list)  # each scale: targets, drain, result
    requests: int = 0
    failures: list[str] = field(default_factory=list)


def plan(seed: int, events: int, requests: int) -> tuple[list[tuple[float, dict[str, int], float]], list[dict]]:
    """(delay before, targets, drain timeout) per scale event; one dict per request."""
    rng = random.Random(seed)
    schedule = []
    for _ in range(events):
        targets = {}
        if rng.random() < 0.3:  # a shift at 3 workers (2P1D <-> 1P2D): drains first under max_workers 3
            prefill = rng.randint(1, 2)
            targets = {"prefill": prefill, "decode": 3 - prefill}
        if not targets and rng.random() < 0.7:
            targets["decode"] = rng.randint(1, 2)
        if not targets or (len(targets) == 1 and "decode" in targets and rng.random() < 0.7):
            targets["prefill"] = rng.randint(0, 2)
        schedule.append((rng.uniform(0.0, 1.5), targets, rng.choice([0.0, 0.3, 30.0])))
    reqs = [{"prompt": [rng.randrange(2, VOCAB) for _ in range(rng.choice([3, 12, 40, 90]))],
             "max_tokens": rng.randint(1, 40), "n": 2 if rng.random() < 0.15 else 1} for _ in range(requests)]
    return schedule, reqs


def expected_text(oracle: Oracle, prompt: list[int], max_tokens: int) -> str:
    """The text the router makes of the oracle's tokens (the same detokenizer)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    detok = Detokenizer.for_params(oracle.llm.tokenizer, params)
    text, _ = detok.add(oracle.tokens(prompt, max_tokens))
    return text + detok.flush()


def run_scale_seed(seed: int, base: str, model: str, scaler: Any, oracle: Oracle, events: int = 3,
                   requests: int = 16, clients: int = 3) -> ScaleRun:
    schedule, reqs = plan(seed, events, requests)
    wants = [expected_text(oracle, r["prompt"], r["max_tokens"]) for r in reqs]  # first: the oracle is one engine
    run = ScaleRun(seed)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120, max_retries=0)
    done = threading.Event()

    def one(i: int) -> None:
        r = reqs[i]
        try:
            out = client.completions.create(model=model, prompt=r["prompt"], max_tokens=r["max_tokens"],
                                            temperature=0.0, n=r["n"], extra_body={"ignore_eos": True})
            want = wants[i]
            for choice in out.choices:
                if choice.text != want or choice.finish_reason != "length":
                    run.failures.append(f"seed {seed} request {i} {r}: got {choice.text!r} "
                                        f"({choice.finish_reason}), want {want!r}")
        except Exception as exc:  # noqa: BLE001 - a failed request is the finding
            run.failures.append(f"seed {seed} request {i} {r}: {type(exc).__name__}: {exc}")
        run.requests += 1

    def scale_events() -> None:
        try:
            for delay, targets, drain in schedule:
                time.sleep(delay)
                scaler.drain_timeout_s = drain
                before = scaler.sizes()
                try:
                    result = scaler.scale(**targets, reason=f"fuzz seed {seed}").as_dict()
                except ScaleError as exc:  # targets drawn blind to the sizes: past max_workers is refused
                    if "autoscale.max_workers" not in str(exc) or scaler.sizes() != before:
                        run.failures.append(f"seed {seed} scale {targets}: {exc}")
                        return
                    run.events.append({"targets": targets, "drain": drain, "refused": str(exc)})
                    continue
                except Exception as exc:  # noqa: BLE001 - a failed scale is the finding
                    run.failures.append(f"seed {seed} scale {targets} (drain {drain}): {type(exc).__name__}: {exc}")
                    return
                run.events.append({"targets": targets, "drain": drain, "result": result})
        finally:
            done.set()

    events_thread = threading.Thread(target=scale_events, name=f"fuzz-scale-{seed}")
    events_thread.start()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(len(reqs))))
    events_thread.join(timeout=300)
    if events_thread.is_alive():
        run.failures.append(f"seed {seed}: a scale event did not end within 300 s")
    return run
