"""Diagnostic --only profile: where the GPU time of a decode step goes (helpers in
benchmarks/gpu/profiling.py)."""

from __future__ import annotations

import functools
from pathlib import Path

from benchmarks.gpu.decode_step import fill_decode_batch, mean_step_seconds, replay_seconds
from benchmarks.gpu.model import build_model, free_memory, make_llm, prompts
from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import Setup


def check_profile(s: Setup, work: Path) -> None:
    """Where a decode step's GPU time goes: torch.profiler over a steady batch of
    max(step_batches) at context ~step_context, run eagerly and then with the CUDA graphs,
    on one engine. Both are needed: a graph is captured with the decode splits of the
    longest context it serves (engine/cuda_graphs.py), an eager step with those of its own
    context, so their attention and split-reduction kernels differ."""
    from benchmarks.gpu import profiling

    model_dir = work / "bf16"
    if not (model_dir / "config.json").exists():  # the engine section, if it ran, left it
        build_model(s, model_dir, s.dtype)
    b = max(s.step_batches)
    llm = make_llm(model_dir, s, s.dtype, max_num_seqs=b,
                   max_num_batched_tokens=8192 if s.device != "cpu" else 64)
    core = llm.core
    graphs = core.runner.graphs
    ids = fill_decode_batch(core, prompts(s, b, s.step_context, seed=4 + b), tag="profile")
    modes = [("eager", None)] + ([("graph", graphs)] if graphs is not None else [])
    walls: dict[str, float] = {}
    try:
        for mode, mode_graphs in modes:
            core.runner.graphs = mode_graphs  # None: every step runs the eager forward
            for _ in range(2):  # settle (and, eagerly, launch every kernel once)
                core.step()
            walls[mode] = mean_step_seconds(core, s.device, 8)
        replay = replay_seconds(graphs, b, s.device) if graphs is not None else None
        stats, errors = profiling.profile_modes(
            core.step, [(mode, functools.partial(setattr, core.runner, "graphs", g)) for mode, g in modes],
            s.device, steps=5)
    finally:
        core.runner.graphs = graphs
    profiles = {mode: profiling.StepProfile(stats.get(mode, {}), 5, walls[mode],
                                              replay if mode == "graph" else None) for mode, _ in modes}
    unit = "kernel" if s.device.startswith("cuda") else "aten op"  # CPU: ops' self time stand in
    print(f"  decode b{b} ctx~{s.step_context}+, 5 profiled steps per mode, ms per step:")
    for line in profiling.format_profile(profiles, unit):
        print("  " + line, flush=True)
    summary = "; ".join(f"{m} {p.total_ms():.2f} / {p.wall_s * 1e3:.2f}"
                        + (f" (replay {p.replay_s * 1e3:.2f})" if p.replay_s is not None else "")
                        for m, p in profiles.items())
    row(f"profile b{b}: {unit}s / wall, ms per step", summary, "(info)")
    for mode, error in errors.items():
        row(f"profile b{b} {mode} steps", error, "(error)")
    last = next((m for m in reversed(profiles) if profiles[m].kernels), None)
    if last is not None:
        row(f"profile b{b} groups, {last}", ", ".join(f"{g} {ms:.2f}" for g, ms in profiles[last].groups().items()),
            "(info)")
    core.abort(ids)
    del llm
    free_memory(s)
