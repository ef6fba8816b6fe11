"""Row 3 of the GPU check: the engine's decode step at a steady batch, against the
memory floor (weights + KV bytes at HBM speed)."""

from __future__ import annotations

import time

from benchmarks.gpu.model import prompts
from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import HBM_BYTES_PER_S, Setup
from benchmarks.gpu.timing import median_seconds, sync


def fill_decode_batch(core, s: Setup, b: int, tag: str = "step") -> list[str]:
    """Add b requests of step_context-token prompts and step until every one has its
    first token: a steady decode batch of b at context ~step_context. Returns their ids."""
    from engine import SamplingParams

    ids = [f"{tag}{b}-{i}" for i in range(b)]
    for rid, p in zip(ids, prompts(s, b, s.step_context, seed=4 + b)):
        core.add_request(rid, p, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    return ids


def mean_step_seconds(core, device: str, steps: int) -> float:
    """Mean time of `steps` consecutive steps, with no sync between them: with async
    scheduling each step's host work overlaps the previous step on the GPU, and a sync
    would drain that pipeline (a synchronous step waits for its own tokens anyway)."""
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    sync(device)
    return (time.perf_counter() - start) / steps


def replay_seconds(graphs, b: int, device: str) -> float:
    """Median time of replaying the CUDA graph that serves a decode batch of b."""
    graph = graphs.graphs[next(x for x in graphs.buckets if x >= b)][0]
    return median_seconds(graph.replay, device, 20)


def time_decode_steps(llm, s: Setup, b: int, label: str = "") -> float:
    """Decode step time at a steady batch of b: prefill everything, then time steps."""
    import torch

    core, cfg = llm.core, llm.core.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in core.model.parameters())
    ids = fill_decode_batch(core, s, b)
    step = mean_step_seconds(core, s.device, 20)
    ctx = s.step_context + 20
    kv_bytes = b * ctx * cfg.kv_bytes_per_token(torch.tensor([], dtype=getattr(torch, s.dtype)).element_size())
    floor = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S
    graphs, replay = core.runner.graphs, ""
    if graphs is not None:  # the GPU's share of the step; the rest is host work
        replay = f", graph replay {replay_seconds(graphs, b, s.device) * 1e3:.2f} ms"
    last = b == max(s.step_batches)
    row(f"decode step b{b} ctx~{ctx}{label}",
        f"{step * 1e3:.2f} ms = {step / floor:.2f}x floor ({floor * 1e3:.2f} ms){replay}",
        "<= 1.5x" if last else "(info)", step / floor <= 1.5 if last else None)
    core.abort(ids)
    while core.has_unfinished():  # an async engine's last step is still in flight
        core.step()
    return step
