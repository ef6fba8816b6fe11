"""Row 3 of the GPU check: the engine's decode step at a steady batch, against the
roofline floor summed over kernel classes (benchmarks/offline/roofline/analytic.py) at the
H200's roofs. The step timer here is also the roofline report's (benchmarks/offline/roofline/)."""

from __future__ import annotations

import statistics
import time

from benchmarks.gpu.model import prompts
from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import Setup
from benchmarks.gpu.timing import median_seconds, sync
from benchmarks.offline.roofline.analytic import ModelShape, Step, dtype_bytes, step_cost
from benchmarks.offline.roofline.roofs import H200

STEPS = 20  # timed decode steps per batch


def fill_decode_batch(core, batch_prompts: list[list[int]], tag: str = "step", steps: int = 63) -> list[str]:
    """Add one request per prompt and step until every one has its first token: a
    steady decode batch whose next step runs at context len(prompt), for `steps` steps
    at least (then its requests may finish). Returns their ids."""
    from engine import SamplingParams

    b = len(batch_prompts)
    ids = [f"{tag}{b}-{i}" for i in range(b)]
    for rid, p in zip(ids, batch_prompts):
        core.add_request(rid, p, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    return ids


def release_batch(core, ids: list[str]) -> None:
    """Abort a batch that fill_decode_batch made, and let an async engine's last step land."""
    core.abort(ids)
    while core.has_unfinished():
        core.step()


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
    graph = graphs.graphs[next(x for x in graphs.buckets if x >= b)]
    return median_seconds(graph.replay, device, 20)


def time_decode_steps(llm, s: Setup, b: int, label: str = "") -> float:
    """Decode step time at a steady batch of b: prefill everything, then time steps."""
    core = llm.core
    ids = fill_decode_batch(core, prompts(s, b, s.step_context, seed=4 + b))
    step = mean_step_seconds(core, s.device, STEPS)
    # Timed step k runs at context step_context + k: the floor is the mean over them.
    shape, width = ModelShape.from_model_config(core.model_config), dtype_bytes(s.dtype)
    costs = [step_cost(shape, Step.decode(b, s.step_context + k), width) for k in range(STEPS)]
    floor = statistics.fmean(c.floor(H200) for c in costs)
    memory_floor = statistics.fmean(c.bytes / H200.bytes_per_s for c in costs)
    graphs, replay = core.runner.graphs, ""
    if graphs is not None:  # the GPU's share of the step; the rest is host work
        replay = f", graph replay {replay_seconds(graphs, b, s.device) * 1e3:.2f} ms"
    last = b == max(s.step_batches)
    row(f"decode step b{b} ctx~{s.step_context + STEPS}{label}",
        f"{step * 1e3:.2f} ms = {step / floor:.2f}x floor ({floor * 1e3:.2f} ms per kernel class; "
        f"all bytes alone {memory_floor * 1e3:.2f} ms){replay}",
        "<= 1.3x" if last else "(info)", step / floor <= 1.3 if last else None)
    release_batch(core, ids)
    return step
