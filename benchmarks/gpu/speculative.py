"""The GPU check's n-gram speculative decoding rows: greedy tokens equal to the plain
engine's in float32 on the device, then output tokens/s with and without n-gram drafts on
repetitive prompts (the bf16 model of rows 3-5b) and the drafts' acceptance rate. The
model is random, so its acceptance says little of a real model's: the timing rows are
information, not targets (the CPU figures on a real model: benchmarks/offline/speculative.py)."""

from __future__ import annotations

import random
import time
from pathlib import Path

from benchmarks.gpu.model import build_model, free_memory, make_llm, prompts
from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import Setup
from benchmarks.gpu.timing import sync

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def repetitive_prompts(s: Setup, n: int, seed: int) -> list[list[int]]:
    """A random span repeated: n-grams of the prompt find drafts from the first step."""
    rng = random.Random(seed)
    span = max(8, s.prompt_len // 8)
    return [[rng.randrange(100, s.vocab - 100) for _ in range(span)] * (s.prompt_len // span) for _ in range(n)]


def check_speculative(s: Setup, work: Path) -> None:
    from engine import SamplingParams

    # Exactness in float32 (as row 5's HF check): random and repetitive prompts, batched.
    small = min(s.hidden, 512)
    fp32_dir = build_model(s, work / "fp32-spec", "float32", layers=2, hidden=small,
                           heads=max(s.heads // s.kv_heads, small // 64))
    batch = prompts(s, 4, 64, seed=1) + repetitive_prompts(s, 4, seed=2)
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    tokens = {}
    for name, spec in (("plain", None), ("ngram", NGRAM)):
        llm = make_llm(fp32_dir, s, "float32", max_num_seqs=8, speculative_config=spec)
        tokens[name] = [o.token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]
        if spec is not None:
            stats = llm.core.speculator.stats
            drafts, rate = stats.num_draft_tokens, stats.acceptance_rate
        del llm
        free_memory(s)
    same = sum(a == b for a, b in zip(tokens["plain"], tokens["ngram"]))
    # Without drafts verified the equality would prove nothing.
    row("ngram k=4 == plain engine, greedy float32",
        f"{same}/{len(batch)} requests identical, {drafts} draft tokens verified (acceptance {rate:.2f})",
        "all, drafts > 0", same == len(batch) and drafts > 0)

    bf16_dir = work / "bf16"  # the engine section's model (same seed) when it ran first
    if not (bf16_dir / "config.json").exists():
        bf16_dir = build_model(s, bf16_dir, s.dtype)
    new_tokens = 2 * s.new_tokens
    for b in (1, 16) if s.device != "cpu" else (1, 2):
        workload = repetitive_prompts(s, b, seed=10 + b)
        rates, acceptance = {}, ""
        for name, spec in (("plain", None), ("ngram", NGRAM)):
            llm = make_llm(bf16_dir, s, s.dtype, max_num_seqs=max(16, b), speculative_config=spec)
            rates[name] = output_rate(llm, s, workload, new_tokens)
            if spec is not None:
                stats = llm.core.speculator.stats
                acceptance = (f", acceptance {stats.acceptance_rate:.2f}, "
                              f"mean accepted length {stats.mean_accepted_length:.2f}")
            del llm
            free_memory(s)
        row(f"ngram k=4 vs plain, {s.dtype}, batch {b}, repetitive prompts",
            f"{rates['ngram']:,.0f} vs {rates['plain']:,.0f} tok/s = {rates['ngram'] / rates['plain']:.2f}x"
            + acceptance, "(info)")


def output_rate(llm, s: Setup, workload: list[list[int]], new_tokens: int) -> float:
    """Output tokens/s of LLM.generate, the median of 3 runs after a warm-up (every run
    the same prompts: after the first, their prefill is a prefix-cache hit in both
    engines alike)."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(workload, params, use_tqdm=False)
    times = []
    for _ in range(3):
        sync(s.device)
        start = time.perf_counter()
        llm.generate(workload, params, use_tqdm=False)
        sync(s.device)
        times.append(time.perf_counter() - start)
    return len(workload) * new_tokens / sorted(times)[1]
