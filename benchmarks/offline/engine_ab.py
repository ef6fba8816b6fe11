"""The engine's prefill throughput and decode step time, A/B between two source trees.

    git archive <base> | tar -x -C /tmp/base    # the tree to compare against
    .venv/bin/python -m benchmarks.offline engine_ab --trees /tmp/base . --rounds 5

One engine process per tree, each importing the engine from its tree only; the driver
runs them in lockstep, one step of A then the same step of B, so both see the same
moments of this (shared, drifting) machine. Each round of a (batch, prompt) case adds
`batch` distinct prompts of `prompt` tokens (no prefix-cache hits), steps them through
prefill under the default 512-token budget (prompts are chunked, and later chunks
read their prefix back from the cache), then times `steps` decode steps of all
`batch` requests. Reported per tree: prefill prompt tokens per second (median over
rounds) and the median decode step (over all rounds' steps); B / A of those medians,
and the median of B / A over paired samples (a round's prefill, a step). Uses only
the engine's public LLM / EngineCore verbs, so older trees run it unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def serve(args: argparse.Namespace) -> None:
    """Worker: one engine; a JSON command per stdin line, a JSON reply per stdout line."""
    import torch

    import engine
    from engine import LLM, SamplingParams

    tree = Path(os.environ["PYTHONPATH"]).resolve()
    assert Path(engine.__file__).resolve().is_relative_to(tree), f"engine from {engine.__file__}, not {tree}"
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, num_threads=args.threads, kv_cache_memory_gib=args.kv_gib)
    core, requests = llm.core, []
    llm.generate([[100 + j for j in range(64)]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "add":
            params = SamplingParams(max_tokens=args.steps + 2, ignore_eos=True, temperature=0.0)
            requests = [core.add_request(f"{cmd['tag']}-{i}", p, params) for i, p in enumerate(cmd["prompts"])]
            reply = {}
        elif cmd["op"] == "step":
            prefill = not all(r.num_output_tokens for r in requests)
            start = time.perf_counter()
            core.step()
            reply = {"seconds": time.perf_counter() - start, "prefill": prefill,
                     "prefilled": all(r.num_output_tokens for r in requests)}
        else:  # drain
            while core.has_unfinished():
                core.step()
            reply = {}
        print(json.dumps(reply), flush=True)


class Worker:
    def __init__(self, tree: str, argv: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
        # The script's own directory (benchmarks/offline/) heads sys.path, so `engine` comes from
        # PYTHONPATH: the tree under test.
        self.proc = subprocess.Popen([sys.executable, __file__, *argv, "--worker"], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return json.loads(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs=2, metavar=("A", "B"), required=True, help="source tree roots")
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--cases", default="1x1024,8x768", help="BATCHxPROMPT, comma-separated")
    p.add_argument("--steps", type=int, default=10, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-gib", type=float, default=1.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        serve(args)
        return
    argv = ["--model", str(Path(args.model).resolve()), "--steps", str(args.steps),
            "--threads", str(args.threads), "--kv-gib", str(args.kv_gib), "--trees", *args.trees]
    workers = [Worker(tree, argv) for tree in args.trees]
    rows: list[tuple[str, list[list[float]]]] = []  # (metric, [A's samples, B's samples])
    for n, case in enumerate(args.cases.split(",")):
        batch, prompt = map(int, case.split("x"))
        prefill_rates: list[list[float]] = [[], []]
        decode_steps: list[list[float]] = [[], []]
        for r in range(args.rounds):
            seed = (n * args.rounds + r) * 1009
            prompts = [[(seed + i * 31 + j) % 20000 + 100 for j in range(prompt)] for i in range(batch)]
            busy = [0.0, 0.0]
            for w in workers:
                w.call(op="add", tag=f"{case}-{r}", prompts=prompts)
            done = False
            while not done:  # both engines schedule alike: their steps pair up
                replies = [w.call(op="step") for w in workers]
                assert replies[0]["prefill"] == replies[1]["prefill"], "the engines' schedules diverged"
                for i, reply in enumerate(replies):
                    busy[i] += reply["seconds"]
                done = replies[0]["prefilled"]
            for i in range(2):
                prefill_rates[i].append(batch * prompt / busy[i])
            for _ in range(args.steps):
                for i, w in enumerate(workers):
                    decode_steps[i].append(w.call(op="step")["seconds"] * 1e3)
            for w in workers:
                w.call(op="drain")
            print(f"{case} round {r + 1}: prefill tok/s {prefill_rates[0][-1]:.1f} / {prefill_rates[1][-1]:.1f}",
                  file=sys.stderr, flush=True)
        rows.append((f"prefill {case}, prompt tok/s", prefill_rates))
        rows.append((f"decode step {case}, ms", decode_steps))
    for w in workers:
        w.proc.stdin.close()
        w.proc.wait()
    a, b = args.trees
    print(f"\n{args.rounds} rounds, steps alternating between the trees, {args.threads} thread(s)")
    print(f"| metric | A: {a} | B: {b} | B / A | B / A, paired |\n|---|---:|---:|---:|---:|")
    for name, (xa, xb) in rows:
        ma, mb = statistics.median(xa), statistics.median(xb)
        # Each sample of B against A's of the same round or step: the drift cancels.
        paired = statistics.median(y / x for x, y in zip(xa, xb))
        print(f"| {name} | {ma:.1f} | {mb:.1f} | {mb / ma:.3f} | {paired:.3f} |")


if __name__ == "__main__":
    main()
