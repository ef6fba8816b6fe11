"""What verifying drafts costs on CPU: the step time with d drafts per request against one
token per request, and where it goes.

    .venv/bin/python -m benchmarks.offline speculative_cost --json docs/data/speculative-cost-cpu.json

For each batch and each d, an engine (the demo model, float32) whose proposer always
drafts d tokens (the copy of the last token, as tests/unit/test_speculative.py replaces
it; min_acceptance_rate 0 so that no request stops speculating) decodes `--context`-token
random prompts: the median of `--steps` steps timed in this process's CPU time (one
thread: what another process's load on a shared machine changes least), then as many
profiled (cProfile: each part in PARTS, inclusive, as a share of the profiled steps,
times the timed step; the C kernels are ctypes calls, counted in their Python wrappers).
d = 0 is the plain engine. benchmarks/offline/speculative.py gives the speedups (and the real
proposer's time); this says why they are what they are.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import LLM, SamplingParams  # noqa: E402
from engine.speculative import speculator as speculator_module  # noqa: E402

PARTS = {"linear": ("cpu_linear.py", "forward"),
         "attention, decode kernel": ("cpu_decode.py", "paged_decode_attention"),
         "attention, d+1 rows (gather, sdpa)": ("reference.py", "gather_kv", "causal_attention"),
         "sampler": ("sampler.py", "sample")}


def always_draft(tokens, room: int, *_) -> list[int]:
    return [tokens[-1]] * room


def measure(args: argparse.Namespace, batch: int, drafts: int, rng: random.Random) -> dict:
    spec = None if drafts == 0 else {"method": "ngram", "num_speculative_tokens": drafts,
                                     "min_acceptance_rate": 0.0}
    llm = LLM(args.model, dtype="float32", num_threads=args.threads, max_num_seqs=batch,
              kv_cache_memory_gib=args.kv_gib, enable_prefix_caching=False, speculative_config=spec)
    core = llm.core
    vocab = core.model_config.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(100, vocab) for _ in range(args.context)]
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in core.scheduler.running) or core.scheduler.num_waiting:
        core.step()  # prefill
    times = []
    for _ in range(args.steps):
        start = time.process_time()
        core.step()
        times.append(time.process_time() - start)
    profile = cProfile.Profile()
    profile.runcall(lambda: [core.step() for _ in range(args.steps)])
    stats = pstats.Stats(profile).stats  # {(file, line, function): (calls, ncalls, tottime, cumtime, callers)}
    total = sum(v[2] for v in stats.values())
    step_ms = statistics.median(times) * 1e3
    parts_ms = {name: step_ms / total * sum(v[3] for (file, _, fn), v in stats.items()
                                            if file.endswith(where[0]) and fn in where[1:])
                for name, where in PARTS.items()}
    return {"batch": batch, "drafts": drafts, "cpu_ms_per_step": step_ms, "parts_ms": parts_ms}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--drafts", default="0,1,2,3,4,5", help="drafts per request per step (0: the plain engine)")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=10, help="steps timed, and then profiled, per setting")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-gib", type=float, default=1.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    speculator_module.propose_ngram = always_draft
    started = os.getloadavg()
    rng = random.Random(1)
    rows = [measure(args, int(b), int(d), rng) for b in args.batches.split(",") for d in args.drafts.split(",")]
    base = {r["batch"]: r["cpu_ms_per_step"] for r in rows if r["drafts"] == 0}
    print(f"\none step with d drafts per request, context {args.context}, {args.threads} thread(s), CPU ms, median "
          f"of {args.steps} steps; its parts by their share of the profiled steps\n")
    print("| batch | drafts | tokens computed | ms / step | vs no drafts | " + " | ".join(PARTS) + " |")
    print("|---:|---:|---:|---:|---:|" + "---:|" * len(PARTS))
    for r in rows:
        r["vs_no_drafts"] = r["cpu_ms_per_step"] / base[r["batch"]] if r["batch"] in base else None
        ratio = "" if r["vs_no_drafts"] is None else f"{r['vs_no_drafts']:.2f}x"
        print(f"| {r['batch']} | {r['drafts']} | {r['batch'] * (r['drafts'] + 1)} | {r['cpu_ms_per_step']:.1f} | "
              f"{ratio} | " + " | ".join(f"{r['parts_ms'][n]:.1f}" for n in PARTS) + " |")
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "threads": args.threads,
              "loadavg": {"start": started, "end": os.getloadavg()}, "rows": rows}
    print(f"\nload average {started[0]:.2f} at the start, {report['loadavg']['end'][0]:.2f} at the end")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
