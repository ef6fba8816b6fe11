"""Measured step times of the real engine (engine.LLM on a model directory): decode
steps at a steady batch for each (batch, context), with benchmarks/gpu/decode_step.py's
timer, and prefill steps of a chunk after a cached context. Each figure is the median
over windows; CUDA is synchronised around each window (benchmarks/gpu/timing.py)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks.gpu.decode_step import fill_decode_batch, mean_step_seconds, release_batch
from benchmarks.gpu.timing import sync


@dataclass(frozen=True)
class Measured:
    """One measured figure: `seconds` is the median over `samples` windows of a window's
    mean step time. context: the prompt length (decode) or the cached prefix (prefill);
    the timed steps ran at cached contexts `timed_contexts` (a decode batch's grows)."""

    kind: str  # "decode" or "prefill"
    batch: int
    new_tokens: int
    context: int
    seconds: float
    samples: int
    timed_contexts: tuple[int, ...]


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids away from the ends of the vocabulary (special tokens sit there)."""
    rng = random.Random(seed)
    low, high = min(100, vocab // 4), max(vocab - 100, vocab * 3 // 4)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(n)]


def make_engine(model_dir: str, device: str, dtype: str, max_batch: int, max_tokens: int,
                kv_gib: float, threads: int | None = None, load_format: str = "safetensors"):
    """The engine to time: synchronous scheduling (one step, one sync), every batch in
    one step, a KV pool big enough for the largest batch."""
    from engine import LLM

    options = dict(dtype=dtype, device=device, max_num_seqs=max_batch, max_num_batched_tokens=max_tokens,
                   load_format=load_format)
    if device == "cpu":
        options.update(kv_cache_memory_gib=kv_gib, num_threads=threads)
    return LLM(model=model_dir, **options)


def decode_steps(core, device: str, batches: Sequence[int], contexts: Sequence[int], vocab: int,
                 steps: int, windows: int, progress: Callable[[Measured], None] | None = None) -> list[Measured]:
    # Each batch size once at a short context first: the first steps an engine runs at a
    # new batch size carry one-time costs that one settling step does not absorb.
    for b in batches:
        release_batch(core, _steady(core, b, 16, vocab, steps=3))
    out = []
    for context in contexts:
        for b in batches:
            ids = fill_decode_batch(core, random_prompts(b, context, vocab, seed=1000 * b + context),
                                    tag=f"roof{context}-", steps=1 + steps * windows)  # never drains while timed
            try:
                mean_step_seconds(core, device, 1)  # settle: the first step after a prefill
                times = [mean_step_seconds(core, device, steps) for _ in range(windows)]
            finally:
                release_batch(core, ids)
            # Step k after the fill runs at context + k; step 0 was the settling one.
            timed = tuple(range(context + 1, context + 1 + steps * windows))
            out.append(Measured("decode", b, 1, context, statistics.median(times), windows, timed))
            if progress is not None:
                progress(out[-1])
    return out


def _steady(core, b: int, context: int, vocab: int, steps: int) -> list[str]:
    ids = fill_decode_batch(core, random_prompts(b, context, vocab, seed=b), tag="warm")
    for _ in range(steps):
        core.step()
    return ids


def prefill_steps(core, device: str, chunk: int, context: int, vocab: int, repeats: int) -> Measured:
    """One step computing `chunk` new prompt tokens after `context` tokens that are a
    prefix-cache hit (context: a multiple of the block size), median of repeats."""
    from engine import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefix = random_prompts(1, context, vocab, seed=7)[0]
    if context:
        core.add_request("roof-prefix", prefix, one)
        while core.has_unfinished():
            core.step()
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        fresh = random_prompts(1, chunk, vocab, seed=100 + i)[0]
        core.add_request(f"roof-prefill-{i}", prefix + fresh, one)
        sync(device)
        start = time.perf_counter()
        computed = core.step().num_tokens
        sync(device)
        times.append(time.perf_counter() - start)
        while core.has_unfinished():
            core.step()
        if computed != chunk:
            raise RuntimeError(f"the prefill step computed {computed} tokens, not the {chunk}-token chunk "
                               f"after a {context}-token cached context (is the context a multiple of the "
                               f"block size, and max_num_batched_tokens >= the chunk?)")
    return Measured("prefill", 1, chunk, context, statistics.median(times[1:]), repeats, (context,))
