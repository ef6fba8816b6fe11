"""Random schedules of parallel-sampling groups against an oracle.

    .venv/bin/python -m tests.fuzz.groups --seeds 0:400     # the long run (none recorded in docs/benchmarks/ yet)

Each seed draws an engine (a small KV pool, so sequences preempt and the stuck-sequence
fallback runs; async scheduling, prefix caching, the token budget and max_num_seqs on
or off) and a schedule of up to 8 requests of n in 1..4 sharing prompt prefixes, with
random aborts of single sequences before and after their fork. Every sequence that
finishes must give exactly the tokens of a single request with its derived params
(params.child(i)) alone in an engine of its own, and the engine must end with every
block free: no leak, no double free, no hang.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from tests.tiny_models import build_tiny_model

BLOCK_SIZE = 8


def run_seed(model: Path, seed: int, wall_limit_s: float = 60.0) -> list[str]:
    """The seed's problems (empty: it passed)."""
    rng = random.Random(f"groups-{seed}")
    num_blocks = rng.randint(8, 24)
    options = dict(block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, async_scheduling=rng.random() < 0.5,
                   max_num_batched_tokens=rng.choice([8, 16, 64]), enable_prefix_caching=rng.random() < 0.8,
                   max_num_seqs=rng.choice([2, 4, 8]))
    core = EngineCore(EngineConfig(model=str(model), **options))
    base = [rng.randrange(1, 200) for _ in range(24)]
    expected: dict[str, tuple[list[int], SamplingParams]] = {}
    live: set[str] = set()
    got: dict[str, list[int]] = {}
    added = 0
    end = time.monotonic() + wall_limit_s

    def finish(requests) -> None:
        for r in requests:
            live.discard(r.request_id)
            if r.status != RequestStatus.FINISHED_ABORTED:
                got[r.request_id] = list(r.output_token_ids)

    while added < 8 or core.has_unfinished():
        if time.monotonic() > end:
            return [f"seed {seed}: no end within {wall_limit_s:g} s ({options})"]
        if added < 8 and rng.random() < 0.3:
            length = rng.randint(1, 26)
            prompt = (base[:rng.randint(0, length)] + [rng.randrange(1, 200) for _ in range(length)])[:length]
            params = SamplingParams(max_tokens=rng.randint(1, 6), n=rng.choice([1, 2, 3, 4]), temperature=0.8,
                                    seed=added, ignore_eos=True)
            try:
                request = core.add_request(f"r{added}", prompt, params)
            except ValueError:
                request = None  # does not fit this pool: refused, nothing queued
            if request is not None:
                sequences = request.sequences if request.sequences is not None else [request]
                for i, sequence in enumerate(sequences):
                    live.add(sequence.request_id)
                    expected[sequence.request_id] = (prompt, params.child(i) if params.n > 1 else params)
            added += 1
        if live and rng.random() < 0.1:
            victim = rng.choice(sorted(live))
            finish(core.abort([victim]))
            live.discard(victim)
        if core.has_unfinished():
            finish(core.step().finished)
    problems = []
    if live:
        problems.append(f"seed {seed}: never finished: {sorted(live)}")
    if core.kv.num_free_blocks != num_blocks or core.kv.req_blocks:
        problems.append(f"seed {seed}: {num_blocks - core.kv.num_free_blocks} blocks still held "
                        f"({sorted(core.kv.req_blocks)}) ({options})")
    oracle = EngineCore(EngineConfig(model=str(model), block_size=BLOCK_SIZE, num_kv_blocks=64,
                                     enable_prefix_caching=False))
    for rid, tokens in got.items():
        prompt, params = expected[rid]
        oracle.add_request("oracle", prompt, params)
        alone: list[int] = []
        while oracle.has_unfinished():
            for r in oracle.step().finished:
                alone = list(r.output_token_ids)
        if alone != tokens:
            problems.append(f"seed {seed}: {rid} gave {tokens}, alone {alone} ({options})")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0:100", help="START:END")
    args = parser.parse_args()
    start, stop = map(int, args.seeds.split(":"))
    model = build_tiny_model("llama", Path(tempfile.mkdtemp()) / "llama")
    problems = [p for seed in range(start, stop) for p in run_seed(model, seed)]
    print("\n".join(problems) or f"seeds {start}..{stop - 1}: every sequence equals its single request, no leak")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
