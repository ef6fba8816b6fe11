"""Rows 3-5b of the GPU check on one Llama-3.2-1B-shaped bf16 model: greedy tokens
against HF, offline throughput against HF generate, a prefill step, decode steps
(decode_step.py), async scheduling against the synchronous engine, CUDA graphs
against eager."""

from __future__ import annotations

import functools
import time
from pathlib import Path

from benchmarks.gpu.decode_step import time_decode_steps
from benchmarks.gpu.model import build_model, free_memory, hf_greedy, make_llm, prompts
from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import Setup
from benchmarks.gpu.timing import median_seconds, sync


def check_engine(s: Setup, work: Path) -> None:
    from engine import SamplingParams

    model_dir = build_model(s, work / "bf16", s.dtype)
    fidelity_batch = prompts(s, 8, 64, seed=2)
    hf_tokens, _ = hf_greedy(model_dir, s, s.dtype, fidelity_batch, 32)
    workload = prompts(s, s.requests, s.prompt_len, seed=3)
    _, hf_seconds = hf_greedy(model_dir, s, s.dtype, workload[:s.hf_batch], s.new_tokens)
    hf_rate = s.hf_batch * s.new_tokens / hf_seconds

    llm = make_llm(model_dir, s, s.dtype, max_num_seqs=max(s.step_batches),
                   max_num_batched_tokens=8192 if s.device != "cpu" else 64)
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    graph_tokens = [o.token_ids for o in llm.generate(fidelity_batch, greedy, use_tqdm=False)]
    matches = sum(a == b for x, y in zip(graph_tokens, hf_tokens) for a, b in zip(x, y))
    row(f"greedy vs HF, {s.dtype}", f"{matches / (len(hf_tokens) * 32):.1%} of tokens match", "(info)")

    rate = offline_rate(llm, s, workload)
    row("offline throughput vs HF", f"{rate:,.0f} vs {hf_rate:,.0f} tok/s = {rate / hf_rate:.1f}x",
        ">= 25x", rate / hf_rate >= 25)  # issue 19, P1

    # One 8192-token step: 16 512-token prompts, new ones each time (a prompt seen before
    # would be a prefix-cache hit and compute only its last block).
    prefill = functools.partial(prefill_next, llm, iter([prompts(s, 16, s.prompt_len, seed=100 + i)
                                                         for i in range(4)]))
    seconds = median_seconds(prefill, s.device, 3)
    layer_weights = sum(p.numel() for n, p in llm.core.model.named_parameters()
                        if n.startswith("layers.") and p.dim() == 2)
    flops = 2 * layer_weights * 16 * s.prompt_len
    row("prefill step, 16 x 512 new tokens", f"{seconds * 1e3:.1f} ms, {flops / seconds / 1e12:.0f} TFLOP/s "
        "(the layers' linears)", "(info)")
    sync_steps = {b: time_decode_steps(llm, s, b) for b in s.step_batches}
    del llm, prefill  # both hold the engine: its GPU memory goes back before the next one
    free_memory(s)
    check_async_scheduling(s, model_dir, fidelity_batch, graph_tokens, workload, hf_rate, sync_steps)

    if s.device.startswith("cuda"):
        eager = make_llm(model_dir, s, s.dtype, max_num_seqs=max(s.step_batches), enforce_eager=True)
        eager_tokens = [o.token_ids for o in eager.generate(fidelity_batch, greedy, use_tqdm=False)]
        same = eager_tokens == graph_tokens
        row("CUDA graphs == eager, greedy tokens", "identical" if same else "differ", "identical", same)
        del eager
        free_memory(s)


def prefill_next(llm, batches) -> None:
    """Prefill the next batch of prompts (one token each)."""
    from engine import SamplingParams

    llm.generate(next(batches), SamplingParams(max_tokens=1), use_tqdm=False)


def offline_rate(llm, s: Setup, workload: list[list[int]]) -> float:
    """Output tokens per second of LLM.generate over the whole workload (after a warm-up)."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=s.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(workload[:8], params, use_tqdm=False)
    sync(s.device)
    start = time.perf_counter()
    llm.generate(workload, params, use_tqdm=False)
    sync(s.device)
    return s.requests * s.new_tokens / (time.perf_counter() - start)


def check_async_scheduling(s: Setup, model_dir: Path, fidelity_batch: list[list[int]],
                           sync_tokens: list[list[int]], workload: list[list[int]], hf_rate: float,
                           sync_steps: dict[int, float]) -> None:
    """The engine rows again with async scheduling (the host schedules step N+1 while the
    GPU runs step N), and with every request of the offline workload in one batch."""
    from engine import SamplingParams

    gpu = s.device != "cpu"
    # The engine rows' setting, then every request in one batch with twice the prefill
    # chunk: fewer, larger steps for an offline workload.
    for max_seqs, max_tokens in ((max(s.step_batches), 8192 if gpu else 64), (s.requests, 16384 if gpu else 128)):
        llm = make_llm(model_dir, s, s.dtype, max_num_seqs=max_seqs, async_scheduling=True,
                       max_num_batched_tokens=max_tokens)
        label = f"async scheduling, max_num_seqs {max_seqs}, max_num_batched_tokens {max_tokens}"
        if max_seqs == max(s.step_batches):
            greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
            tokens = [o.token_ids for o in llm.generate(fidelity_batch, greedy, use_tqdm=False)]
            row("async scheduling == sync, greedy tokens", "identical" if tokens == sync_tokens else "differ",
                "identical", tokens == sync_tokens)
            for b in s.step_batches:
                step = time_decode_steps(llm, s, b, label=", async")
                row(f"decode step b{b}: sync / async", f"{sync_steps[b] / step:.2f}x", "(info)")
        rate = offline_rate(llm, s, workload)
        row(f"offline throughput vs HF, {label}", f"{rate:,.0f} vs {hf_rate:,.0f} tok/s = {rate / hf_rate:.1f}x",
            ">= 25x", rate / hf_rate >= 25)
        del llm
        free_memory(s)
