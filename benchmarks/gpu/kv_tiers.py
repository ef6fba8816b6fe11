"""The tiers section (issue 37's device path: a pinned host tier, copies on a CUDA stream
of their own, events; a disk tier below it): a multi-turn chat whose working set is
several times the engine's KV pool, run by an engine with that small pool and its tiers,
against the same engine with a pool that holds everything and no tiers. In float32, so
that a block computed again where a tier dropped it gives the same bytes: greedy tokens
identical, blocks loaded back from each tier, none failed. Then (information) the
load-back rate (bytes loaded / the loads' summed time) and the chat's wall time against
the small pool without tiers (every evicted turn computed again)."""

from __future__ import annotations

import random
import time
from pathlib import Path

from benchmarks.gpu.model import build_model, free_memory
from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import Setup

BLOCK = 16  # tokens per KV block (the engine's default)
CONVERSATIONS, TURNS = 8, 4


def chat(s: Setup, seed: int = 0) -> list[list[list[int]]]:
    """Per turn, each conversation's prompt: a shared system prompt, then its turns so far
    (each turn's answer is not fed back: the prompts are fixed, whatever is generated)."""
    rng = random.Random(seed)
    system_len, turn_len = (256, 96) if s.device != "cpu" else (32, 12)
    system = [rng.randrange(3, s.vocab) for _ in range(system_len)]
    convs = [list(system) for _ in range(CONVERSATIONS)]
    turns = []
    for _ in range(TURNS):
        for conv in convs:
            conv += [rng.randrange(3, s.vocab) for _ in range(turn_len)]
        turns.append([list(c) for c in convs])
    return turns


def run_chat(llm, turns: list[list[list[int]]], new_tokens: int) -> tuple[list[list[int]], float]:  # type: ignore[no-untyped-def]  # engine.LLM, imported late
    from engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    tokens, start = [], time.perf_counter()
    for prompts in turns:
        tokens += [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    return tokens, time.perf_counter() - start


def check_kv_tiers(s: Setup, work: Path) -> None:
    from engine import LLM

    layers = min(s.layers, 4)
    model_dir = build_model(s, work / "tiers_model", "float32", layers=layers)
    head_dim = s.hidden // s.heads
    block_gib = BLOCK * layers * 2 * s.kv_heads * head_dim * 4 / 2**30
    turns = chat(s)
    new_tokens = 16 if s.device != "cpu" else 4
    blocks = [-(-(len(p) + new_tokens) // BLOCK) for p in turns[-1]]
    working_set = sum(blocks)
    pool = max(max(blocks) + 2, working_set // 4)  # a quarter of the chat, and room for its longest prompt
    base = dict(model=str(model_dir), dtype="float32", device=s.device, block_size=BLOCK)
    if s.device == "cpu":
        base["attention_backend"] = s.cpu_attention_backend

    def engine(**options):  # type: ignore[no-untyped-def]
        llm = LLM(**base, **options)
        try:
            tokens, wall = run_chat(llm, turns, new_tokens)
            return tokens, wall, llm.stats().offload
        finally:
            llm.core.close()
            free_memory(s)

    expected, _, _ = engine(num_kv_blocks=4 * working_set)
    recompute, recompute_s, _ = engine(num_kv_blocks=pool)
    row(f"tiers: a pool of {pool} blocks alone gives the large pool's tokens", "identical" if recompute == expected
        else "DIFFERENT", "identical", recompute == expected)
    arms = {"host (pinned)": dict(kv_offload_gib=4 * working_set * block_gib),
            "disk (below a 4-block host tier)": dict(kv_offload_gib=4 * block_gib,
                                                     kv_offload_dir=str(work / "tiers_disk"),
                                                     kv_offload_disk_gib=4 * working_set * block_gib)}
    for name, options in arms.items():
        tokens, wall, stats = engine(num_kv_blocks=pool, **options)
        hits = {t.name: t.hits for t in stats.tiers} if stats is not None else {}
        failed = stats.failed_loads if stats is not None else -1
        loaded = ", ".join(f"{n} {h}" for n, h in hits.items())
        row(f"tiers {name}: greedy tokens vs a pool holding all {working_set} blocks",
            f"{'identical' if tokens == expected else 'DIFFERENT'}; blocks loaded back: {loaded}; {failed} loads failed",
            "identical, > 0 loaded, 0 failed", tokens == expected and sum(hits.values()) > 0 and failed == 0)
        if stats is not None and stats.load_seconds > 0:
            row(f"tiers {name}: load-back rate, and the chat against recomputing",
                f"{stats.loaded_bytes / stats.load_seconds / 1e9:.2f} GB/s over {stats.loads} loads; "
                f"chat {wall:.2f} s vs {recompute_s:.2f} s without tiers ({recompute_s / wall:.2f}x)", "(info)")
