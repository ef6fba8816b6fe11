"""Host overhead of a pure-decode engine step, measured on CPU with a tiny model.

    .venv/bin/python -m benchmarks.offline host_overhead                 # batches 64 and 256
    .venv/bin/python -m benchmarks.offline host_overhead --batches 256 --steps 50 --profile 0

On a GPU a decode step replays a CUDA graph, and everything else in the step is host
Python: scheduling, flattening the batch, staging uploads, sampling, bookkeeping. A
random Llama far too small to matter (hidden 64, 2 layers, vocab 512) keeps the model's
compute small on CPU, so what this measures is that host work. Each batch runs B
requests with ~1000-token prompts (greedy, ignore_eos), steps until every one is
decoding, then times pure decode steps through EngineCore.step plus the offline LLM's
per-step stop-string check. Reported per step (medians), twice:

  real model   the forward still reads B x ~1000 tokens of KV on the CPU, which also
               evicts the host's data from the CPU caches between steps
  stub model   runner.model returns fixed logits: host work alone, as on a GPU, where
               the forward does not touch the host's caches

    step      the whole step
    forward   the model call (runner.model): compute, not host overhead
    host      step - forward, split into schedule / inputs (build_step_inputs) /
              attn prepare (the CPU torch backend's; a CUDA-graph step skips it) /
              sample (Sampler) / update (Scheduler.update) / other

Then cProfile over stub-model steps lists where the host time goes.

With --device cuda, pure-decode steps replay CUDA graphs: runner.model is not called
("forward" reads 0, the replay of this tiny model is in "other"), there is no stub run,
and "step" is close to the host time on that machine.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import engine.runner as runner_module  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine_core import EngineCore  # noqa: E402
from engine.output_processor import OutputProcessor  # noqa: E402
from engine.sampling import PendingSample  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

VOCAB = 512


def build_tiny_llama(out_dir: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    return out_dir


class Timers:
    """Accumulates seconds and calls per label for the current step."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[label] += time.perf_counter() - start
                self.count[label] += 1
        return timed

    def reset(self) -> None:
        self.step.clear()
        self.count.clear()


def instrument(core: EngineCore, timers: Timers) -> None:
    """Time the step's parts by wrapping them (per-instance or the runner's module global)."""
    runner = core.runner
    runner.model = timers.wrap("forward", runner.model)
    runner.attention_backend.prepare = timers.wrap("attn prepare", runner.attention_backend.prepare)
    runner.sampler.sample = timers.wrap("sample", runner.sampler.sample)  # queues the sampling
    PendingSample.result = timers.wrap("sample", PendingSample.result)  # waits for its tokens
    core.scheduler.schedule = timers.wrap("schedule", core.scheduler.schedule)
    core.scheduler.update = timers.wrap("update", core.scheduler.update)
    runner_module.build_step_inputs = timers.wrap("inputs", runner_module.build_step_inputs)


def one_step(core: EngineCore, outputs: OutputProcessor) -> None:
    """What LLM._run does per step, minus the progress bar."""
    step = core.step()
    outputs.check_stop_strings(step.advanced)


def fill(core: EngineCore, outputs: OutputProcessor, batch: int, prompt_len: int, max_tokens: int,
         tag: str) -> list[str]:
    """Add `batch` requests and step until every one is decoding."""
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = []
    for i in range(batch):
        prompt = [rng.randrange(3, VOCAB) for _ in range(prompt_len + rng.randrange(-16, 17))]
        request = core.add_request(f"{tag}-{i}", prompt, params)
        outputs.add(request, None)
        ids.append(request.request_id)
    while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        one_step(core, outputs)
    return ids


class StubModel(torch.nn.Module):
    """Fixed logits, no compute: what is left of a step is host work."""

    def __init__(self, max_rows: int) -> None:
        super().__init__()
        self.logits = torch.randn(max_rows, VOCAB, generator=torch.Generator().manual_seed(0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor) -> torch.Tensor:
        return self.logits[:len(logits_indices)]


def timed_steps(core: EngineCore, outputs: OutputProcessor, timers: Timers, batch: int,
                steps: int) -> dict[str, float]:
    """Median ms per step of the whole step and of each timed part."""
    for _ in range(3):  # warm-up
        one_step(core, outputs)
    per_step: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        timers.step.clear()
        start = time.perf_counter()
        one_step(core, outputs)
        total = time.perf_counter() - start
        assert len(core.scheduler.running) == batch, "every request must still be decoding"
        parts = dict(timers.step)
        per_step["step"].append(total)
        per_step["host"].append(total - parts.get("forward", 0.0))
        for label in ("forward", "schedule", "inputs", "attn prepare", "sample", "update"):
            per_step[label].append(parts.get(label, 0.0))
        per_step["other"].append(total - sum(parts.values()))
    return {label: statistics.median(v) * 1e3 for label, v in per_step.items()}


def measure(core: EngineCore, outputs: OutputProcessor, timers: Timers, batch: int, steps: int,
            prompt_len: int, profile_steps: int) -> dict[str, dict[str, float]]:
    """{"real": ..., "stub": ...} results for one batch size ("real" only under CUDA graphs,
    which replay the captured model whatever runner.model is)."""
    ids = fill(core, outputs, batch, prompt_len, 512 + 2 * steps + profile_steps, f"b{batch}")
    results = {"real": timed_steps(core, outputs, timers, batch, steps)}
    model = core.runner.model
    if core.runner.graphs is None:
        core.runner.model = timers.wrap("forward", StubModel(batch))
        results["stub"] = timed_steps(core, outputs, timers, batch, steps)
    if profile_steps:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(profile_steps):
            one_step(core, outputs)
        profiler.disable()
        print(f"\n--- cProfile, batch {batch}, {profile_steps} decode steps "
              f"({'stub' if 'stub' in results else 'real'} model), by own time ---")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(22)
    core.runner.model = model
    for request in core.abort(ids):
        outputs.discard(request.request_id)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per batch")
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--profile", type=int, default=15,
                        help="decode steps under cProfile at the largest batch (0: none)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the forward only)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: CUDA graphs, as served")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="schedule each step while the one before is in flight (EngineConfig.async_scheduling)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_llama(Path(tmp) / "tiny-llama")
        blocks_per_seq = -(-(args.prompt_len + 17 + 512 + 2 * args.steps + args.profile) // 16)
        core = EngineCore(EngineConfig(
            model=str(model_dir), device=args.device, max_num_seqs=max(args.batches),
            max_num_batched_tokens=8192, max_model_len=4096, num_threads=args.threads,
            num_kv_blocks=max(args.batches) * blocks_per_seq + 64, async_scheduling=args.async_scheduling))
    outputs = OutputProcessor(None)
    timers = Timers()
    instrument(core, timers)

    results = {}
    for b in args.batches:
        profile = args.profile if b == max(args.batches) else 0
        results[b] = measure(core, outputs, timers, b, args.steps, args.prompt_len, profile)

    labels = ["step", "forward", "host", "schedule", "inputs", "attn prepare", "sample", "update", "other"]
    mode = "async scheduling" if args.async_scheduling else "synchronous"
    print(f"\nms per pure-decode step on {args.device}, {mode} (median of {args.steps}), context ~{args.prompt_len}:")
    print("model  batch" + "".join(f"{label:>13}" for label in labels))
    for name in ("real", "stub"):
        for b, r in results.items():
            if name in r:
                print(f"{name:<5} {b:>6}" + "".join(f"{r[name][label]:>13.3f}" for label in labels))


if __name__ == "__main__":
    main()
