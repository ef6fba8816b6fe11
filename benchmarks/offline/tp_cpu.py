"""Tensor parallelism on CPU: TP 1 with 2 threads against TP N with 1 thread per rank.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.offline tp_cpu                  # ~10 min on 2 cores
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.offline tp_cpu --rounds 1 --steps 5 --no-demo   # smoke

Two pairs of engines, all alive in this process at once (rank 0 of each; followers are
idle between their own steps, blocked on their stdin), measured in turn, the order
flipped every round; each config's torch threads are set before it runs:

  8q/2kv   the demo model's dimensions (hidden 576, 30 layers, intermediate 1536,
           vocab 49152, head_dim 64, tied embeddings) with 8 query and 2 KV heads,
           random weights (seed 0), float32: TP 1 x 2 threads vs TP 2 x 1 thread
  demo     models/SmolLM2-135M-Instruct (9 query, 3 KV heads), float32:
           TP 1 x 2 threads vs TP 3 x 1 thread (3 processes on 2 cores: oversubscribed)

First a correctness check: greedy tokens of the TP engine equal TP 1's on a few
prompts. Then per round and config:

  decode   32 sequences of --decode-prompt tokens filled until all decode, then
           --steps timed EngineCore.step() calls at B = 32, 8, 1 (requests aborted
           down to B in between): median ms per step; at TP > 1 also rank 0's time
           per step in all-reduces, the logits gather and the step broadcast (these
           include waiting for the slowest rank)
  prefill  8 prompts of 256 tokens (max_tokens 1, prefix caching off, chunked at the
           default 512 tokens a step): prompt tokens per second

and the collectives alone (engine/distributed/group.py TorchGroup, gloo, 1 thread per
rank, both ranks looping the same ops): the step broadcast (StepCodec's buffer), the
all-reduce of [T, 576] activations and the logits gather. Reported: medians over
rounds of each round's median.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.offline.host_overhead import Timers  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.distributed.group import TorchGroup  # noqa: E402
from engine.distributed.step_codec import StepCodec  # noqa: E402
from engine.engine_core import EngineCore  # noqa: E402

DEMO = _REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
HIDDEN, VOCAB = 576, 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
MAX_B = 32


def build_8q2kv(out_dir: Path) -> Path:
    """The demo model's dimensions with 8 query / 2 KV heads (TP 2 divides it), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (DEMO / name).exists():
            shutil.copy(DEMO / name, out_dir / name)
    return out_dir


@dataclass
class Config:
    label: str
    model: str
    tp: int
    threads: int
    llm: LLM | None = None

    def start(self, num_kv_blocks: int) -> None:
        self.llm = LLM(self.model, tensor_parallel_size=self.tp, num_threads=self.threads,
                       enable_prefix_caching=False, num_kv_blocks=num_kv_blocks)

    @property
    def core(self) -> EngineCore:
        return self.llm.core


class CollectiveTimes(Timers):
    """Rank 0's seconds per step in its group's collectives (wrapped on the instances)."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__()
        if core.tp is None:
            return
        group = core.tp.group
        group.all_reduce_ = self.wrap("all-reduce", group.all_reduce_)
        group.gather_last_dim = self.wrap("gather", group.gather_last_dim)
        # The runner calls the driver's broadcast_step (the stdin ring + the broadcast): an
        # instance attribute shadows the method for that call.
        core.tp.broadcast_step = self.wrap("broadcast", core.tp.broadcast_step)


def rank0_bytes(core: EngineCore) -> tuple[int, int]:
    """(bytes of rank 0's model tensors, bytes of its KV cache per token), storages counted
    once; the layers' views of the KV cache are not model tensors."""
    kv = core.kv_cache
    seen, total = {kv.untyped_storage().data_ptr()}, 0
    for m in core.model.modules():
        tensors = [*m._parameters.values(), *m._buffers.values(),
                   *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]
        for t in tensors:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total, kv.numel() * kv.element_size() // (core.kv.pool.num_blocks * core.config.block_size)


def random_prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


def check_tokens(base: Config, tp: Config) -> bool:
    """Greedy tokens of the TP engine against TP 1's, printed."""
    rng = random.Random(7)
    prompts = [p[0] for p in (random_prompts(rng, 1, n) for n in (5, 37, 100, 256))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in base.llm.generate(prompts, params, use_tqdm=False)]
    got = [o.token_ids for o in tp.llm.generate(prompts, params, use_tqdm=False)]
    same = want == got
    print(f"check {tp.label}: greedy tokens of TP {tp.tp} {'==' if same else '!='} TP {base.tp} "
          f"on {len(prompts)} prompts (lengths 5, 37, 100, 256; 16 tokens each)", flush=True)
    if not same:
        for i, (w, g) in enumerate(zip(want, got)):
            if w != g:
                print(f"  prompt {i}: TP {base.tp} {w}\n  prompt {i}: TP {tp.tp} {g}", flush=True)
    return same


def measure_decode(cfg: Config, times: CollectiveTimes, rng: random.Random, prompt_len: int,
                   steps: int, batches: list[int]) -> dict[str, float]:
    """Median ms per decode step at each B (and rank 0's collective ms per step)."""
    core, warm = cfg.core, 3
    params = SamplingParams(max_tokens=len(batches) * (steps + warm) + 8, temperature=0.0, ignore_eos=True)
    ids = [core.add_request(f"d{rng.random()}", p, params).request_id
           for p in random_prompts(rng, max(batches), prompt_len)]
    while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        core.step()
    out: dict[str, float] = {}
    for b in sorted(batches, reverse=True):
        core.abort(ids[b:])
        ids = ids[:b]
        for _ in range(warm):
            core.step()
        per_step: dict[str, list[float]] = defaultdict(list)
        for _ in range(steps):
            times.reset()
            start = time.perf_counter()
            core.step()
            per_step["step"].append(time.perf_counter() - start)
            assert len(core.scheduler.running) == b, "every request must still be decoding"
            for label in ("all-reduce", "gather", "broadcast"):
                per_step[label].append(times.step.get(label, 0.0))
        if core.tp is not None:
            assert times.count["all-reduce"] == 2 * core.model_config.num_layers + 1, times.count
        for label, values in per_step.items():
            out[f"decode B={b} {label}"] = statistics.median(values) * 1e3
    core.abort(ids)
    return out


def measure_prefill(cfg: Config, rng: random.Random, n: int, length: int) -> dict[str, float]:
    core = cfg.core
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for p in random_prompts(rng, n, length):
        core.add_request(f"p{rng.random()}", p, params)
    start = time.perf_counter()
    while core.has_unfinished():
        core.step()
    return {"prefill tok/s": n * length / (time.perf_counter() - start)}


def measure_round(r: int, configs: list[Config], times: dict[str, CollectiveTimes], args: argparse.Namespace,
                  results: dict[str, dict[str, list[float]]]) -> None:
    """Round r: every config's decode steps and prefill rate, in turn (the order flipped
    every other round), appended to results[label]."""
    rng = random.Random(1000 + r)
    print(f"round {r}: load average {os.getloadavg()}", flush=True)
    for cfg in configs if r % 2 == 0 else configs[::-1]:
        torch.set_num_threads(cfg.threads)
        res = measure_decode(cfg, times[cfg.label], rng, args.decode_prompt, args.steps, args.batches)
        res.update(measure_prefill(cfg, rng, *args.prefill))
        for k, v in res.items():
            results[cfg.label][k].append(v)
        print(f"round {r} {cfg.label}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()
                                                    if k.endswith("step") or "tok/s" in k), flush=True)


# --- the collectives alone --------------------------------------------------------

def collective_plan(size: int, codec_size: int) -> list[tuple[str, str, tuple[int, ...]]]:
    plan = [(f"broadcast step buffer ({codec_size * 4 // 1024} KiB)", "broadcast", (codec_size,))]
    plan += [(f"all-reduce [{t}, {HIDDEN}]", "all_reduce", (t, HIDDEN)) for t in (1, 8, 32, 512)]
    plan += [(f"gather logits [{b}, {VOCAB // size}] x {size}", "gather", (b, VOCAB // size)) for b in (1, 8, 32)]
    return plan


def run_collectives(rank: int, size: int, port: int, codec_size: int, reps: int,
                    store: dist.TCPStore | None = None) -> dict[str, float]:
    """Every rank runs the same ops in the same order (interleaved, so that each op sees
    the same conditions); rank 0's median ms per op."""
    torch.set_num_threads(1)
    group = TorchGroup(rank, size, port, 60.0, torch.device("cpu"), store)
    calls = {"broadcast": group.broadcast_, "all_reduce": group.all_reduce_, "gather": group.gather_last_dim}
    ops = [(label, calls[op], torch.zeros(shape, dtype=torch.int32 if op == "broadcast" else torch.float32))
           for label, op, shape in collective_plan(size, codec_size)]
    samples: dict[str, list[float]] = defaultdict(list)
    for i in range(reps + 10):
        for label, call, x in ops:
            start = time.perf_counter()
            call(x)
            if i >= 10:
                samples[label].append(time.perf_counter() - start)
    out = {label: statistics.median(v) * 1e3 for label, v in samples.items()}
    group.close()
    return out


def _collective_follower(rank: int, size: int, port: int, codec_size: int, reps: int) -> None:
    run_collectives(rank, size, port, codec_size, reps)


def measure_collectives(size: int, codec_size: int, reps: int) -> dict[str, float]:
    store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_collective_follower, args=(r, size, store.port, codec_size, reps))
             for r in range(1, size)]
    for p in procs:
        p.start()
    threads = torch.get_num_threads()
    try:
        return run_collectives(0, size, store.port, codec_size, reps, store)
    finally:
        torch.set_num_threads(threads)
        for p in procs:
            p.join(timeout=60)


# --- main ---------------------------------------------------------------------------

def round_parser(doc: str | None, steps: int = 10, decode_prompt: int = 64, prefill: int = 4) -> argparse.ArgumentParser:
    """The options measure_round reads (rounds, steps, batches, decode prompt, prefill), for
    the benchmarks built on it."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=steps, help="timed decode steps per batch size")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--decode-prompt", type=int, default=decode_prompt, help="prompt tokens of the decoding sequences")
    parser.add_argument("--prefill", type=int, nargs=2, default=[prefill, 256], metavar=("N", "LEN"))
    return parser


def round_blocks(args: argparse.Namespace) -> int:
    """KV blocks an engine needs for measure_round: MAX_B decoding sequences to the end
    of their steps, or the prefill batch."""
    per_seq = -(-(args.decode_prompt + len(args.batches) * (args.steps + 3) + 16) // 16)
    return max(MAX_B * per_seq, args.prefill[0] * -(-args.prefill[1] // 16)) + 16


def run_rounds(configs: list[Config], args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """args.rounds of measure_round over started configs; closes them all at the end."""
    results: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    try:
        times = {c.label: CollectiveTimes(c.core) for c in configs}
        for r in range(args.rounds):
            measure_round(r, configs, times, args, results)
    finally:
        close_configs(configs)
    return results


def close_configs(configs: list[Config]) -> None:
    for cfg in configs:
        if cfg.llm is not None:
            cfg.core.close()


def parse_rounds(parser: argparse.ArgumentParser) -> argparse.Namespace:
    args = parser.parse_args()
    if max(args.batches) > MAX_B:
        parser.error(f"batches up to {MAX_B} (max_num_seqs 64, KV blocks sized for {MAX_B})")
    return args


def main() -> None:
    parser = round_parser(__doc__, steps=15, prefill=8)
    parser.add_argument("--collective-reps", type=int, default=100)
    parser.add_argument("--no-demo", action="store_true", help="skip the demo model's TP 1 / TP 3 pair")
    args = parse_rounds(parser)

    print(f"load average before: {os.getloadavg()}", flush=True)
    tmp = tempfile.mkdtemp(prefix="tp_cpu_")
    configs: list[Config] = []
    memory: dict[str, tuple[int, int]] = {}
    same_tokens = True
    try:
        model = str(build_8q2kv(Path(tmp) / "llama-8q2kv"))
        pairs = [(Config("8q/2kv TP1x2t", model, 1, 2), Config("8q/2kv TP2x1t", model, 2, 1))]
        if not args.no_demo:
            pairs.append((Config("demo TP1x2t", str(DEMO), 1, 2), Config("demo TP3x1t", str(DEMO), 3, 1)))
        blocks = round_blocks(args)
        for pair in pairs:
            for cfg in pair:
                start = time.perf_counter()
                cfg.start(blocks)
                configs.append(cfg)
                memory[cfg.label] = rank0_bytes(cfg.core)
                print(f"started {cfg.label} in {time.perf_counter() - start:.1f} s", flush=True)
            torch.set_num_threads(max(c.threads for c in pair))
            same_tokens &= check_tokens(*pair)
        codec: StepCodec = configs[1].core.tp.codec
        times = {c.label: CollectiveTimes(c.core) for c in configs}
        results: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        sizes = sorted({c.tp for c in configs if c.tp > 1})

        for r in range(args.rounds):
            measure_round(r, configs, times, args, results)
            for size in sizes:
                for k, v in measure_collectives(size, codec.size, args.collective_reps).items():
                    results[f"collectives, {size} ranks"][k].append(v)
    finally:
        for cfg in configs:
            cfg.core.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average after: {os.getloadavg()}")
    report(results, configs, memory, args)
    if not same_tokens:
        sys.exit("greedy tokens differed between tensor-parallel sizes (printed above)")


def report(results: dict[str, dict[str, list[float]]], configs: list[Config],
           memory: dict[str, tuple[int, int]], args: argparse.Namespace) -> None:
    med = {name: {k: statistics.median(v) for k, v in res.items()} for name, res in results.items()}
    print(f"\nmedians of {args.rounds} rounds (each a median of {args.steps} steps)")
    bs = sorted(args.batches)
    header = "| config | " + " | ".join(f"decode B={b} ms/step" for b in bs) + " | prefill tok/s |"
    print(header + "\n|" + "---|" * (len(bs) + 2))
    for cfg in configs:
        m = med[cfg.label]
        print(f"| {cfg.label} | " + " | ".join(f"{m[f'decode B={b} step']:.1f}" for b in bs)
              + f" | {m['prefill tok/s']:.0f} |")
    print("\nper rank (rank 0): model tensors MiB, KV cache bytes per token")
    for cfg in configs:
        weights, kv = memory[cfg.label]
        print(f"  {cfg.label:<16} {weights / 2**20:8.0f} MiB {kv:8d} B/token")
    print("\nrank 0's ms per decode step in collectives (incl. waiting for the other ranks):")
    print("| config | B | all-reduces | logits gather | step broadcast | sum | share of step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for cfg in configs:
        if cfg.tp == 1:
            continue
        m = med[cfg.label]
        for b in bs:
            parts = [m[f"decode B={b} {k}"] for k in ("all-reduce", "gather", "broadcast")]
            print(f"| {cfg.label} | {b} | " + " | ".join(f"{p:.2f}" for p in parts)
                  + f" | {sum(parts):.2f} | {sum(parts) / m[f'decode B={b} step']:.0%} |")
    for name, m in med.items():
        if name.startswith("collectives"):
            print(f"\n{name}, 1 thread each, median ms per op (of {args.collective_reps}):")
            for k, v in m.items():
                print(f"  {k:<40} {v:8.3f}")


if __name__ == "__main__":
    main()
