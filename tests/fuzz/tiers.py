"""Random schedules for the KV offload tiers: conversations whose turns extend earlier
prompts, arriving after those have run, into a device pool that holds about one request,
so their prefixes are evicted to the tiers and loaded back; tiers of a few blocks (LRU
eviction, busy slots), a disk tier half the time, aborts at about the time a load runs;
half the "core" seeds share a KV store below their tiers with every seed before them
(tests/fuzz/shared_store.py), a fifth of those restart it mid-seed."""

from __future__ import annotations

import random

from engine.kv_cache.manager import cdiv
from tests.fuzz.cases import _max_tokens, _sampling, _tp_options, tier_options
from tests.fuzz.common import VOCAB, OfflineCase, ReqSpec

# The system prompts seeds with the shared store draw from (a prefix of one each).
SYSTEMS = [[random.Random(f"tiers-system-{k}").randrange(2, VOCAB) for _ in range(67)] for k in range(3)]


def make_tier_case(seed: int, tp: int = 1) -> OfflineCase:
    rng = random.Random(f"tiers-{seed}")
    store = random.Random(f"tiers-store-{seed}")  # its own stream: every other choice stays as it was
    shared, restart_p, k = store.random() < 0.5, store.random(), store.randrange(len(SYSTEMS))
    bs = rng.choice((8, 8, 16))
    system = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 4) * bs + rng.choice((0, 0, 3)))]
    if shared:  # a system prompt other seeds have too: their blocks in the store are this seed's
        system = SYSTEMS[k][:len(system)]
    num_convs, num_turns = rng.randint(1, 5), rng.randint(2, 4)
    convs = [list(system) for _ in range(num_convs)]
    gap = rng.choice((2, 6, 15, 40))  # steps between turns: from overlapping to one after another
    specs: list[ReqSpec] = []
    for turn in range(num_turns):
        for c, conv in enumerate(convs):
            conv += [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 2 * bs))]
            m = _max_tokens(rng)
            spec = ReqSpec(f"c{c}t{turn}", list(conv), m, arrive=turn * gap + rng.choice((0, 0, 1, 3)),
                           params=_sampling(rng, m))
            if rng.random() < 0.15:  # often while its load is in flight
                spec.abort = spec.arrive + rng.choice((0, 1, 1, 2, 5))
            specs.append(spec)
    need = max(cdiv(len(s.prompt) + s.max_tokens, bs) for s in specs)
    engine = dict(block_size=bs, num_kv_blocks=need + rng.choice((0, 1, 2, 4, 8)),
                  max_num_batched_tokens=rng.choice((4, 8, 16, 32, 512)), max_num_seqs=rng.choice((1, 2, 4, 64)),
                  enable_chunked_prefill=True, enable_prefix_caching=True, async_scheduling=rng.random() < 0.5,
                  **tier_options(rng, bs))
    engine.update(_tp_options(tp))
    specs.sort(key=lambda s: s.arrive)
    mode = "llm" if rng.random() < 0.15 else "core"
    shared = shared and mode == "core"
    restart = store.randint(0, 40) if shared and restart_p < 0.2 else None
    return OfflineCase(seed, engine, mode, specs, shared_store=shared, store_restart=restart)
