"""The stream section: a remote prefill's TTFT by streaming mode (transport_options.stream
off, chunk and layer) against the prefill's own compute, 1P1D on the GPU (both workers
on it, as configs/gpu-1p1d.yaml), over cuda_ipc and nixl if its wheel came along; the
CPU smoke run, over shm. The modes' first tokens for each prompt must agree (the same
prompt through each; `off` is the path the other sections check against colocated).
benchmarks/kv/stream.py runs it (its docstring says what each figure is)."""

from __future__ import annotations

import random
from pathlib import Path

from benchmarks.gpu.model import build_model, free_memory
from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import Setup
from benchmarks.gpu.transfer import with_nixl

MODES = ["off", "chunk", "layer"]


def check_streaming(s: Setup, work: Path) -> None:
    from benchmarks.kv.stream import Setup as Engines
    from benchmarks.kv.stream import run_transport
    from benchmarks.kv.transfer import Placement

    model_dir = build_model(s, work / "stream_model", s.dtype)
    free_memory(s)
    for name in with_nixl("cuda_ipc" if s.device != "cpu" else "shm", "stream over nixl"):
        rows, mismatches = run_transport(name, list(s.stream_tokens), MODES, 0, 1, s.stream_repeats, Placement(),
                                         random.Random(0), None, Engines(str(model_dir), s.dtype, s.device))
        prompts = len(s.stream_tokens) * s.stream_repeats + 1  # and the warm-up's, of the shortest
        row(f"stream {name}: first tokens of chunk and layer vs off", f"{mismatches} of {prompts} prompts differ",
            "identical", mismatches == 0)
        for n in s.stream_tokens:
            off = rows[(n, "off")]
            for mode in MODES[1:]:
                m = rows[(n, mode)]
                row(f"stream {name} {n} tokens, {mode}: remote TTFT / compute",
                    f"{m['ratio']:.2f}x (off {off['ratio']:.2f}x); exposed {m['exposed'] * 1e3:.1f} ms "
                    f"(off {off['exposed'] * 1e3:.1f}); compute {m['compute'] * 1e3:.1f} ms", "(info)")
