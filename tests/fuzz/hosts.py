"""Random fault schedules on a multi-host deployment (tests/multihost/test_faults.py's
four hosts), every answer checked against the colocated oracle.

A seed draws requests (random words, some under the router's remote-prefill threshold,
some streamed) and fault events: a partition between the prefill host and a decode host,
between the router and one decode host (one per seed: with both a 503 would be right), or a
decode host's link slowed to 10-100 Mbit/s; each lasts 1-8 s. Requests go out, and
faults start, at random times in one 12 s window. Every request must succeed with the
oracle's text; afterwards, with every link whole, every worker must be live with every
block free and none held.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks.netns_cluster.deployment import REPO, Deployment
from engine import LLM, SamplingParams

ROUTER, PREFILL, DECODES = 1, 2, (3, 4)
DEADLINE_S = 6.0  # prefill_deadline_s: a decode worker waits this long for pushed KV
TRANSPORT_TIMEOUT_S = 5.0  # transport_options.timeout_s: a KV write not acknowledged within this fails
WORKER_TIMEOUT_S = 5.0  # router.worker_timeout_s: silence before a worker is declared dead
GREEDY = {"temperature": 0.0, "ignore_eos": True}
WINDOW_S = 12.0  # requests go out, and faults start, within this many seconds
WORDS = ("cache block token prefill decode router worker batch step prompt layer head rank "
         "stream queue grammar draft verify fence transfer host link partition").split()


class TextOracle:
    """The colocated engine's greedy text for a prompt alone (float32, as served),
    cached per (prompt, max_tokens)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._texts: dict[tuple[str, int], str] = {}

    def __call__(self, prompt: str, max_tokens: int) -> str:
        if (prompt, max_tokens) not in self._texts:
            params = SamplingParams(max_tokens=max_tokens, **GREEDY)
            self._texts[(prompt, max_tokens)] = self.llm.generate([prompt], params, use_tqdm=False)[0].text
        return self._texts[(prompt, max_tokens)]


def write_config(path: Path) -> Path:
    """configs/ray-multinode-cpu.yaml with two decode workers, short timeouts, and KV
    streamed layer by layer (the mode with the most writes in flight when a link is cut
    mid-push; chunk, the default, is what every other deployment test runs)."""
    config = yaml.safe_load((REPO / "configs" / "ray-multinode-cpu.yaml").read_text())
    config.update(prefill_deadline_s=DEADLINE_S, transport_options={"timeout_s": TRANSPORT_TIMEOUT_S, "stream": "layer"})
    config["router"]["worker_timeout_s"] = WORKER_TIMEOUT_S
    config["decode"]["replicas"] = len(DECODES)
    # A router-decode cut longer than ray.probe_timeout_s costs that worker one of its
    # ray.max_restarts (the supervisor kills a silent worker): many seeds on one
    # deployment would use up the default 3, and the worker would stay down.
    config["ray"]["max_restarts"] = 1000
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass(frozen=True)
class Fault:
    kind: str  # "pd" (prefill-decode cut), "router" (router-decode cut), "slow" (a decode link's rate)
    decode: int
    start: float
    seconds: float
    rate: str = ""


@dataclass(frozen=True)
class Ask:
    prompt: str
    max_tokens: int
    stream: bool
    at: float  # seconds after the schedule starts: requests and faults share one window


def draw(seed: int, requests: int, events: int) -> tuple[list[Ask], list[Fault]]:
    rng = random.Random(seed)
    asks = [Ask(" ".join(rng.choice(WORDS) for _ in range(rng.choice((4, 12, 60, 120, 200)))),
                rng.randint(4, 24), rng.random() < 0.5, rng.uniform(0, WINDOW_S)) for _ in range(requests)]
    faults: list[Fault] = []
    for _ in range(events):
        kind = rng.choice(("pd", "router", "slow"))
        decode, start, seconds = rng.choice(DECODES), rng.uniform(0, WINDOW_S), rng.uniform(1, 8)
        if kind == "router" and any(f.kind == "router" and f.decode != decode for f in faults):
            # One decode host per seed is cut off the router. A cut longer than
            # ray.probe_timeout_s restarts its worker, which takes longer than the
            # window: a cut of the other host meanwhile would leave nothing to serve
            # (a 503 is then right: tests/multihost/test_faults.py checks it).
            kind = "pd"
        faults.append(Fault(kind, decode, start, seconds, rng.choice(("10mbit", "40mbit", "100mbit"))))
    return asks, faults


def play(deployment: Deployment, faults: list[Fault], stop: threading.Event) -> None:
    """Apply each fault at its start and undo it at its end (or when `stop` is set)."""
    bed, t0 = deployment.bed, time.monotonic()
    steps = sorted([(f.start, True, f) for f in faults] + [(f.start + f.seconds, False, f) for f in faults],
                   key=lambda s: s[0])
    for at, begin, fault in steps:
        if stop.wait(max(0.0, t0 + at - time.monotonic())):
            return
        a, b = (PREFILL if fault.kind == "pd" else ROUTER), fault.decode
        # Another fault of the same kind on the same link, still running, ends it instead.
        running = [g for g in faults if g is not fault and (g.kind, g.decode) == (fault.kind, b)
                   and g.start <= at < g.start + g.seconds]
        if fault.kind == "slow":
            bed.limit(b, fault.rate if begin else (running[0].rate if running else None))
        elif begin:
            bed.partition(a, b)
        elif not running:
            bed.heal(a, b)


def heal_all(deployment: Deployment) -> None:
    bed = deployment.bed
    for a in range(1, bed.hosts + 1):
        for b in range(a + 1, bed.hosts + 1):
            bed.heal(a, b)
        bed.limit(a, None)


def answer(deployment: Deployment, ask: Ask, t0: float) -> str:
    time.sleep(max(0.0, t0 + ask.at - time.monotonic()))
    body: dict[str, Any] = {"prompt": ask.prompt, "max_tokens": ask.max_tokens, **GREEDY}
    if ask.stream:
        text, events, _ = deployment.stream(body)
        errors = [e for e in events if "error" in e]
        if errors:
            raise RuntimeError(f"stream error: {errors}")
        return text
    return str(deployment.call("/v1/completions", body, timeout=180)["choices"][0]["text"])


def run_hosts_seed(deployment: Deployment, oracle: Any, seed: int, requests: int = 12,
                   events: int = 4) -> list[str]:
    """One seed; `oracle(prompt, max_tokens)` is the colocated engine's text. Returns
    the failures (empty: every answer was the oracle's and the deployment settled)."""
    asks, faults = draw(seed, requests, events)
    stop = threading.Event()
    player = threading.Thread(target=play, args=(deployment, faults, stop), daemon=True)
    failures = []
    player.start()
    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(asks)) as pool:
            futures = [pool.submit(answer, deployment, ask, t0) for ask in asks]
            for ask, future in zip(asks, futures, strict=True):
                try:
                    got = future.result(timeout=300)
                except Exception as e:  # one failure is a finding, not the end of the seed
                    failures.append(f"seed {seed}: {ask} failed: {e!r}")
                    continue
                if got != oracle(ask.prompt, ask.max_tokens):
                    failures.append(f"seed {seed}: {ask} got {got!r}, the oracle {oracle(ask.prompt, ask.max_tokens)!r}")
    finally:
        stop.set()
        player.join(30)
        heal_all(deployment)
    try:
        deployment.wait("every worker live with every block free", settled, timeout=120)
    except AssertionError as e:
        failures.append(f"seed {seed} (faults {faults}): {e}")
    return failures


def settled(workers: dict[str, dict]) -> bool:
    """Every worker live, nothing reserved, held, fenced or in flight: every block free
    (rows of Deployment.workers(), whose stats are a reply to this /status or null)."""
    return len(workers) == 1 + len(DECODES) and all(
        row["live"] and row["stats"]["free_blocks"] == row["stats"]["num_blocks"] and not row["stats"].get("jobs")
        and not row["stats"].get("quarantined_blocks") and not row["stats"].get("waiting_for_kv")
        for row in workers.values())
