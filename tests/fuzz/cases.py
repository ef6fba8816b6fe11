"""The fuzzers' random cases: a pure function of the seed (tests/fuzz/harness.py)."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

from engine.kv_cache.manager import cdiv
from engine.model.config import ModelConfig
from tests.fuzz.common import ENGINE_OPTIONS, MAX_MODEL_LEN, VOCAB, OfflineCase, PDCase, ReqSpec
from tests.fuzz.structured import draw_constraint


def _prompt_pool(rng: random.Random, n: int, block_size: int, max_len: int) -> list[list[int]]:
    """n prompts: fresh ones, prefixes of a few shared bases (often on block boundaries)
    with or without a tail, and identical copies of earlier ones."""
    bases = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(8, max_len))] for _ in range(rng.randint(1, 3))]
    out: list[list[int]] = []

    def length(limit: int) -> int:
        r = rng.random()
        if r < 0.35:  # on or next to a block boundary
            k = rng.randint(0, max(0, limit // block_size))
            return max(1, min(limit, k * block_size + rng.choice((-1, 0, 0, 1))))
        if r < 0.45:
            return rng.choice((1, 2, 3))
        return rng.randint(1, limit)

    for _ in range(n):
        r = rng.random()
        if out and r < 0.2:
            out.append(list(rng.choice(out)))  # identical
        elif r < 0.65:
            base = rng.choice(bases)
            p = base[:length(len(base))]
            if rng.random() < 0.5:
                p = p + [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 12))]
            out.append(p)
        else:
            out.append([rng.randrange(2, VOCAB) for _ in range(length(max_len))])
    return out


def _sampling(rng: random.Random, max_tokens: int) -> dict[str, Any]:
    """Sampling params besides plain greedy for some requests: penalties (their steps
    read the tokens so far: synchronous even with async scheduling), min_tokens with
    stop tokens or EOS, seeded random sampling (batch-invariant by design)."""
    r = rng.random()
    if r < 0.75:
        return {}
    kind = rng.randrange(5)
    if kind == 0:
        return dict(repetition_penalty=rng.choice((0.7, 1.3, 2.0)))
    if kind == 1:
        return dict(presence_penalty=rng.choice((-0.5, 0.8)), frequency_penalty=rng.choice((-0.3, 0.0, 0.6)))
    if kind == 2:  # many stop tokens, so some request does stop early
        return dict(stop_token_ids=sorted(rng.sample(range(2, VOCAB), rng.randint(1, 150))),
                    min_tokens=rng.randint(0, max_tokens), ignore_eos=rng.random() < 0.5)
    if kind == 3:
        return dict(temperature=rng.choice((0.6, 1.0, 1.5)), seed=rng.randrange(2**31),
                    top_k=rng.choice((-1, 5, 50)), top_p=rng.choice((1.0, 0.9, 0.5)))
    return dict(logprobs=rng.choice((0, 3)))  # tokens unchanged


STOP_STRINGS = ["e", "a", "o", "s", "th", " t", "in", "er", ".", "qu"]


def _max_tokens(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.15:
        return 1
    if r < 0.8:
        return rng.randint(2, 12)
    return rng.randint(13, 32)


def _fits(prompt_len: int, max_tokens: int, block_size: int, num_blocks: int, budget: int, chunked: bool,
          max_model_len: int | None = None, window: int = 0) -> bool:
    """Scheduler.check_fits, restated (the fuzzer checks the engine refuses exactly these);
    `window`: the engine's sliding window (kv.sliding_window), within which a request
    runs chunk by chunk in the window's span and 5 more blocks (kv_cache/window.py)."""
    limit = max_model_len or MAX_MODEL_LEN
    if prompt_len < 1 or prompt_len >= limit or prompt_len + max_tokens > limit:
        return False
    if not chunked and prompt_len > budget:
        return False
    prompt, needed = cdiv(prompt_len + 1, block_size), cdiv(prompt_len + max_tokens, block_size)
    if window:
        span = cdiv(window, block_size) + 5
        if span < prompt and span <= num_blocks:  # a long prompt runs chunk by chunk in the span
            prompt = span
        needed = min(needed, max(prompt, span))
    return prompt <= num_blocks and needed <= num_blocks


def _tp_options(tp: int) -> dict[str, Any]:
    """A config at tensor parallel size tp: one torch thread per rank (the oracle stays
    TP 1). Nothing at TP 1, so a TP 1 case is exactly what it was before TP."""
    return dict(tensor_parallel_size=tp, num_threads=1) if tp > 1 else {}


TP_PAIRS = ((1, 1), (1, 2), (2, 1), (2, 2))


def draw_tp_pair(seed: int, transport: str) -> tuple[int, int]:
    """(prefill TP, decode TP) for a seed, from its own stream: the case's other choices
    are the same at every TP."""
    return random.Random(f"pd-tp-{transport}-{seed}").choice(TP_PAIRS)


# The fuzzed tiny llama's KV per token (2 layers x K,V x 2 heads x 16 dims x 4 bytes):
# tier sizes are drawn in blocks.
TINY_KV_BYTES_PER_TOKEN = 512
TIER_DIR = os.path.join(tempfile.gettempdir(), "pdserve-fuzz-kv-tiers")


def tier_options(rng: random.Random, block_size: int) -> dict[str, Any]:
    """KV offload tiers of a few blocks (LRU eviction and busy slots all the time),
    with a disk tier under the host tier half the time."""
    def gib(blocks: int) -> float:
        return (blocks + 0.5) * block_size * TINY_KV_BYTES_PER_TOKEN / 2**30

    options: dict[str, Any] = {"kv_offload_gib": gib(rng.choice((1, 2, 3, 8, 64)))}
    if rng.random() < 0.5:
        options.update(kv_offload_dir=TIER_DIR, kv_offload_disk_gib=gib(rng.choice((1, 4, 64))))
    return options


def fit_tiers(options: dict[str, Any], model_dir: str | Path) -> dict[str, Any]:
    """An engine's options (with ENGINE_OPTIONS) with its tier sizes (drawn in blocks of
    the tiny llama, above) scaled up to the model's KV bytes per token over every rank of
    the engine (an MLA latent once: the tiers keep one copy), so that every model gets
    the blocks drawn; the tiny llama's (and any smaller model's) are left as drawn."""
    options = {**ENGINE_OPTIONS, **options}
    if "kv_offload_gib" not in options:
        return options
    mc = ModelConfig.from_model_dir(model_dir)
    tp = 1 if mc.mla else options.get("tensor_parallel_size", 1)
    per_token = tp * max(1, mc.num_kv_heads // tp) * mc.kv_bytes_per_token(4) // mc.num_kv_heads
    factor = per_token / TINY_KV_BYTES_PER_TOKEN
    if factor <= 1:
        return options
    return {k: v * factor if k in ("kv_offload_gib", "kv_offload_disk_gib") else v for k, v in options.items()}


def make_offline_case(seed: int, tp: int = 1) -> OfflineCase:
    """tp: the fuzzed engine's tensor_parallel_size (the schedule is the same at any)."""
    rng = random.Random(f"offline-{seed}")
    bs = rng.choice((8, 8, 16, 16, 32))
    # pressure: several requests that grow a lot, at about once, into a pool that holds
    # about the largest alone -- preemption (and recompute) is all but certain
    pressure = rng.random() < 0.35
    n = rng.choice((3, 4, 5, 6, 8)) if pressure else rng.choice((1, 2, 3, 4, 5, 6, 8, 10, 12))
    max_len = rng.choice((20, 40, 64, 96))
    prompts = _prompt_pool(rng, n, bs, max_len)
    mts = [rng.randint(bs // 2, 40) if pressure else _max_tokens(rng) for _ in prompts]
    need = max(cdiv(len(p) + m, bs) for p, m in zip(prompts, mts))
    total = sum(cdiv(len(p) + m, bs) for p, m in zip(prompts, mts))
    r = 0.0 if pressure else rng.random()
    if r < 0.25:
        blocks = need + rng.randint(0, 1)  # tiny: preemption galore
    elif r < 0.6:
        blocks = need + rng.randint(1, max(1, total // 2))
    elif r < 0.9:
        blocks = total + rng.randint(0, 16)  # roomy
    else:
        blocks = max(1, need - rng.randint(1, 2))  # some requests can never fit: refused
    budget = rng.choice((1, 2, 3, 4, 5, 7, 8, 13, 16, 24, 32, 64, 128, 512))
    chunked = rng.random() < 0.75
    if not chunked and rng.random() < 0.85:  # else the longer prompts are refused
        budget = max(len(p) for p in prompts) + rng.choice((0, 0, 1, 4, 16))
    engine = dict(block_size=bs, num_kv_blocks=blocks, max_num_batched_tokens=budget,
                  max_num_seqs=rng.choice((1, 2, 3, 4, 8, 64)), enable_chunked_prefill=chunked,
                  enable_prefix_caching=rng.random() < 0.7, async_scheduling=rng.random() < 0.5)
    tiers = random.Random(f"offline-tiers-{seed}")  # its own stream: every other choice stays as it was
    if engine["enable_prefix_caching"] and tiers.random() < 0.5:
        engine.update(tier_options(tiers, bs))
    if rng.random() < 0.2:  # a small context: some requests end exactly at it, a few are refused
        engine["max_model_len"] = max(2, max(len(p) + m for p, m in zip(prompts, mts)) - rng.choice((0, 0, 0, 1, 2)))
    mode = "llm" if rng.random() < 0.2 else "core"
    specs: list[ReqSpec] = []
    arrive = 0
    burst = pressure or rng.random() < 0.3  # all at about once: the most contention
    for i, (p, m) in enumerate(zip(prompts, mts)):
        if mode == "core":
            arrive += rng.choice((0, 0, 0, 1)) if burst else rng.choice((0, 0, 0, 1, 2, 5, rng.randint(0, 40)))
        prio = rng.choice((0, 0, 0, 1, -1, 2)) if rng.random() < 0.3 else 0
        spec = ReqSpec(f"r{i}", p, m, prio, arrive, params=_sampling(rng, m))
        if mode == "llm" and rng.random() < 0.3:  # stop strings: found by LLM's output processor
            spec.params["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 3))
            spec.params["include_stop_str_in_output"] = rng.random() < 0.5
        if mode == "core" and rng.random() < 0.3:
            est = cdiv(len(p), budget) + m + 2
            spec.abort = arrive + rng.randint(0, est)
        specs.append(spec)
    if mode == "core":  # reuse the id of an aborted request at once
        for spec in list(specs):
            if spec.abort is not None and rng.random() < 0.3:
                p = rng.choice(prompts)
                m = _max_tokens(rng)
                specs.append(ReqSpec(spec.rid, list(p), m, 0, spec.abort, params=_sampling(rng, m)))
    if mode == "core":
        _fair_tags(specs, random.Random(f"offline-tags-{seed}"))
    specs.sort(key=lambda s: s.arrive)  # stable: order of creation within a step
    engine.update(_tp_options(tp))
    return OfflineCase(seed, engine, mode, specs)


def _fair_tags(specs: list[ReqSpec], rng: random.Random) -> None:
    """Fair-queuing tags as the router gives them, in a stream of their own (every other
    choice stays as it was): in some cases, each request a tag from a few flows (API keys)
    whose tags rise at their own pace, so that the queues' order is not arrival order."""
    if rng.random() < 0.5:
        return
    finish = [0.0] * rng.randint(1, 3)
    for spec in specs:
        flow = rng.randrange(len(finish))
        spec.queue_tag = finish[flow]
        finish[flow] += rng.choice((1.0, 10.0, 100.0))


def make_pd_case(seed: int, transport: str, bounded_copies: bool = False,
                 tp: tuple[int, int] = (1, 1)) -> PDCase:
    """bounded_copies: a started copy never outlasts cancel_grace_s / 4 (see PDCase).
    tp: (prefill, decode) tensor_parallel_size (the schedule is the same at any)."""
    rng = random.Random(f"pd-{transport}-{seed}")
    bs = rng.choice((8, 16, 16))
    n = rng.choice((1, 2, 3, 4, 5, 6, 8))
    max_len = rng.choice((20, 40, 64, 90))
    prompts = _prompt_pool(rng, n, bs, max_len)
    mts = [_max_tokens(rng) for _ in prompts]
    need = max(cdiv(len(p) + m, bs) for p, m in zip(prompts, mts))
    total = sum(cdiv(len(p) + m, bs) for p, m in zip(prompts, mts))
    r = rng.random()
    dec_blocks = (need + rng.randint(0, 2) if r < 0.35 else
                  need + rng.randint(1, max(1, total // 2)) if r < 0.65 else total + rng.randint(2, 16))
    pneed = max(cdiv(len(p), bs) for p in prompts)
    r = rng.random()
    pre_blocks = (max(1, pneed - 1) if r < 0.1 else pneed + rng.randint(0, 2) if r < 0.45 else
                  pneed * n + rng.randint(0, 8))
    dec_budget = rng.choice((4, 8, 16, 32, 64, 512))
    dec_chunked = rng.random() < 0.85
    if not dec_chunked:
        dec_budget = max(dec_budget, max(len(p) for p in prompts))
    async_sched = rng.random() < 0.5
    dec = dict(block_size=bs, num_kv_blocks=dec_blocks, max_num_batched_tokens=dec_budget,
               max_num_seqs=rng.choice((1, 2, 4, 64)), enable_chunked_prefill=dec_chunked,
               enable_prefix_caching=rng.random() < 0.7, async_scheduling=async_sched)
    pre = dict(block_size=bs, num_kv_blocks=pre_blocks, max_num_batched_tokens=rng.choice((4, 8, 16, 24, 64, 512)),
               max_num_seqs=rng.choice((1, 2, 64)), enable_chunked_prefill=rng.random() < 0.85,
               enable_prefix_caching=rng.random() < 0.7,
               async_scheduling=async_sched if rng.random() < 0.8 else not async_sched)
    tiers = random.Random(f"pd-tiers-{transport}-{seed}")  # its own stream: every other choice stays as it was
    for options, least in ((dec, need), (pre, pneed)):
        if options["enable_prefix_caching"] and tiers.random() < 0.5:
            options.update(tier_options(tiers, bs))
            if tiers.random() < 0.7:  # a pool of about one request: what it evicts comes back from a tier
                options["num_kv_blocks"] = least + tiers.choice((0, 0, 1, 2))
    store = random.Random(f"pd-store-{transport}-{seed}")  # as tiers: a stream of its own
    shared = any("kv_offload_gib" in options for options in (dec, pre)) and store.random() < 0.5
    if rng.random() < 0.15:  # a small context on D: some requests end exactly at it
        dec["max_model_len"] = max(2, max(len(p) + m for p, m in zip(prompts, mts)) - rng.choice((0, 0, 1)))
    short = rng.random() < 0.5
    # "long" still ends a seed's lost prefills and unconfirmed aborts within ~2 s
    deadline_s = rng.choice((0.05, 0.1, 0.2, 0.4)) if short else 1.5
    grace_s = rng.choice((0.05, 0.1, 0.3)) if short else 0.5
    timeout_s = rng.choice((0.1, 0.3, 2.0)) if short else 2.0
    slow = rng.random() < 0.35
    specs = []
    tick = 0
    for i, (p, m) in enumerate(zip(prompts, mts)):
        tick += rng.choice((0, 0, 1, 2, 5, rng.randint(0, 30)))
        spec = ReqSpec(f"q{i}", p, m, rng.choice((0, 0, 0, 1, -1)), tick,
                       remote=rng.random() < 0.8, sender=rng.random() < 0.8, params=_sampling(rng, m))
        f = rng.random()
        if short and f < 0.15:
            spec.fate, spec.fate_at = "lost", rng.choice((-1, rng.randint(0, 20)))
        elif f < 0.25:
            spec.fate, spec.fate_at = "lost", rng.randint(0, 20)
        elif f < 0.35:
            spec.fate, spec.fate_at = "perror", rng.randint(0, 30)
        elif f < 0.42:
            spec.fate, spec.fate_at = "spurious", rng.randint(0, 30)
        if rng.random() < 0.25:
            spec.abort = tick + rng.randint(0, 3 * (len(p) // 8 + m + 2))
        specs.append(spec)
    for spec in list(specs):  # the id of an aborted request, reused (refused while D still holds it)
        if spec.abort is not None and rng.random() < 0.3:
            p = rng.choice(prompts)
            m = _max_tokens(rng)
            specs.append(ReqSpec(spec.rid, list(p), m, 0, spec.abort + rng.choice((0, 0, 1, 5, 20)),
                                 remote=rng.random() < 0.8, sender=rng.random() < 0.8, params=_sampling(rng, m)))
    pre.update(_tp_options(tp[0]))
    dec.update(_tp_options(tp[1]))
    _fair_tags(specs, random.Random(f"pd-tags-{transport}-{seed}"))
    streams = random.Random(f"pd-stream-{transport}-{seed}")  # as tiers: a stream of its own
    stream = streams.choice(("chunk", "chunk", "off", "layer", "layer"))
    stream_min_tokens = streams.choice((0, 0, 16, 48))
    stream_layers = streams.choice((1, 1, 2))
    if stream == "layer" and tp[0] > 1:  # layer streaming needs a TP 1 prefill worker
        stream = "chunk"
    return PDCase(seed, transport, dec, pre, deadline_s, grace_s, timeout_s,
                  slow_copy_p=rng.choice((0.3, 0.7, 1.0)) if slow else 0.0,
                  slow_copy_max_s=rng.choice((0.01, 0.05, 0.2, 0.6)) if slow else 0.0,
                  p_skip=rng.choice((0.0, 0.0, 0.3, 0.7)),
                  jitter_s=rng.choice((0.0, 0.0, 0.002, 0.01)),
                  msg_delay_max=rng.choice((0, 1, 3, 10)), requests=specs,
                  d_skip=rng.choice((0.0, 0.0, 0.0, 0.3, 0.8)), shared_store=shared,
                  copy_bound_s=grace_s / 4 if bounded_copies else 0.0, stream=stream,
                  stream_min_tokens=stream_min_tokens, stream_layers=stream_layers)


def add_structured(case: OfflineCase | PDCase, fraction: float) -> OfflineCase | PDCase:
    """Give about `fraction` of the case's requests a structured_outputs constraint (in
    place; returns the case), from a stream of its own: a fraction of 0 changes nothing,
    and the seed's schedule is the same at any fraction. Some also get seeded sampling
    (if they had none), and some more room (a grammar can end within a few dozen
    tokens) where the engine still fits them, so that as many are refused as before."""
    if fraction <= 0:
        return case
    pd = isinstance(case, PDCase)
    rng = random.Random(f"structured-{case.transport if pd else 'offline'}-{case.seed}")
    e = case.dec if pd else case.engine

    def fits(prompt_len: int, max_tokens: int) -> bool:
        return _fits(prompt_len, max_tokens, e["block_size"], e["num_kv_blocks"], e["max_num_batched_tokens"],
                     e["enable_chunked_prefill"], e.get("max_model_len"))

    for spec in case.requests:
        if rng.random() >= fraction:
            continue
        spec.params["structured_outputs"] = draw_constraint(rng)
        if "temperature" not in spec.params and rng.random() < 0.3:
            spec.params.update(temperature=rng.choice((0.7, 1.0)), seed=rng.randrange(2**31))
        more = rng.randint(12, 40)
        if more > spec.max_tokens and rng.random() < 0.4 and fits(len(spec.prompt), spec.max_tokens) \
                and fits(len(spec.prompt), more):
            spec.max_tokens = more
    return case
