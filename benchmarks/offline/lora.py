"""LoRA adapters' cost: the decode step time of a batch of 32 with 4 different adapters
(8 requests each) against the same batch without adapters, at rank 8 and rank 64; and
an adapter's load time (read and fused, then written into a slot), in one run:

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.offline lora      # ~3 min on 2 cores

The demo model (SmolLM2-135M, float32 on CPU), its 7 projections per layer adapted by
PEFT adapters of random weights (tests/lora_adapters.py's make_adapter). Each arm runs
the batch to steady decode, then times --steps decode steps; medians of --rounds runs.
Arms: no LoRA engine; an enable_lora engine whose requests name no adapter (what the
wrappers cost alone); 4 adapters at rank 8; 4 at rank 64.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import torch  # noqa: E402

from cluster.demo_model import DEMO_MODELS, default_models_dir  # noqa: E402
from engine import LoRARequest, SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine_core import EngineCore  # noqa: E402
from engine.lora.adapter import load_adapter  # noqa: E402
from engine.lora.layers import load_into_slot  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402
from tests.lora_adapters import make_adapter  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BATCH, PROMPT, ADAPTERS = 32, 32, 4


def step_time(model: Path, loras: list[LoRARequest | None], steps: int, max_rank: int | None) -> float:
    """Mean seconds per decode step of BATCH requests, request i naming loras[i % len];
    max_rank None: an engine without enable_lora."""
    options = {} if max_rank is None else dict(enable_lora=True, max_loras=ADAPTERS, max_lora_rank=max_rank)
    core = EngineCore(EngineConfig(model=str(model), num_kv_blocks=512, max_num_seqs=BATCH,
                                   max_num_batched_tokens=BATCH * PROMPT, **options))
    try:
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        for i in range(BATCH):
            prompt = torch.randint(10, 40000, (PROMPT,), generator=g).tolist()
            core.add_request(f"r{i}", prompt, params, lora_request=loras[i % len(loras)])
        for _ in range(4):  # the prompts, then the first decode steps
            core.step()
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        return (time.perf_counter() - start) / steps
    finally:
        core.close()


def load_times(core: EngineCore, adapter: Path, rank: int) -> tuple[float, float]:
    """(seconds to read and fuse the adapter, seconds to write it into a slot of `core`'s)."""
    slots = core.scheduler.loras
    start = time.perf_counter()
    read = load_adapter("bench", adapter, ModelConfig.from_model_dir(core.config.model), rank)
    loaded = time.perf_counter() - start
    start = time.perf_counter()
    load_into_slot(slots.wrapped, 0, read.weights)
    return loaded, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=default_models_dir() / DEMO_MODELS["smollm2"].dir_name)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdserve-lora-") as tmp:
        adapters: dict[int, list[LoRARequest]] = {}
        for rank in (8, 64):
            adapters[rank] = [LoRARequest(f"r{rank}-{i}", 100 * rank + i + 1, str(make_adapter(
                args.model, Path(tmp) / f"r{rank}-{i}", i, r=rank, lora_alpha=2 * rank, target_modules=TARGETS)))
                for i in range(ADAPTERS)]
        arms: list[tuple[str, list[LoRARequest | None], int | None]] = [
            ("no LoRA (enable_lora off)", [None], None), ("enable_lora, no request names an adapter", [None], 8),
            ("4 adapters, rank 8", list(adapters[8]), 8), ("4 adapters, rank 64", list(adapters[64]), 64)]
        print(f"## Decode step time, batch {BATCH} ({PROMPT}-token prompts), {args.model.name}, float32, CPU\n")
        print(f"| arm | step ms (median of {args.rounds}) | vs no LoRA |")
        print("|---|---|---|")
        step_time(args.model, [None], 2, None)  # warm-up: the first engine in a process pays for the rest
        base = 0.0
        for name, loras, rank in arms:
            ms = 1000 * statistics.median(step_time(args.model, loras, args.steps, rank) for _ in range(args.rounds))
            base = base or ms
            print(f"| {name} | {ms:.1f} | {ms / base:.2f}x |", flush=True)
        print("\n## Adapter load time (7 projections x 30 layers)\n")
        print("| rank | read + fuse (median of 3) | into a slot (median of 3) |")
        print("|---|---|---|")
        for rank in (8, 64):
            core = EngineCore(EngineConfig(model=str(args.model), num_kv_blocks=16, enable_lora=True, max_loras=1,
                                           max_lora_rank=rank))
            times = [load_times(core, Path(adapters[rank][0].lora_path), rank) for _ in range(3)]
            core.close()
            print(f"| {rank} | {1000 * statistics.median(t[0] for t in times):.0f} ms | "
                  f"{1000 * statistics.median(t[1] for t in times):.0f} ms |")


if __name__ == "__main__":
    main()
