"""Structured outputs' costs (issue 17): grammar masks per step, compile time, and the
served throughput of a workload with JSON-schema requests against one without.

    .venv/bin/python -m benchmarks.offline structured                       # every section
    .venv/bin/python -m benchmarks.offline structured --only mask,compile   # the CPU-only sections
    .venv/bin/python -m benchmarks.offline structured --only served --config configs/local.yaml
    .venv/bin/python -m benchmarks.offline structured --quick               # a short version of each

Sections (--only, comma-separated):
  mask     per-step ms of filling (xgrammar matchers of the 20-field schema at positions
           spread over a valid document) and applying bitmasks at batch 1/64/256, the
           sampler with every row constrained vs none on the same logits; then a real
           EngineCore decode step at --engine-batch with 0% vs 100% constrained rows
           (same prompts, greedy), rounds alternating, and a profile of where it goes.
  compile  the one-time tokenizer info, the schema's grammar build, a cold compile
           (fresh GrammarCompiler each repeat) and a cache hit.
  validity the demo model's sampled output, 50 requests per kind (json schema, json_object,
           regex, choice, EBNF) at temperature 1: how many end by their grammar, and
           how many of those do not validate (must be 0).
  served   the service of --config (1 prefill + 1 decode, shm, remote prefill in
           configs/local.yaml): bursts of the same prompts and max_tokens with none vs
           --json-share of the requests carrying a json_schema response_format.
Every figure is a median over repeats with the min-max beside it; each comparison is a
ratio against its baseline measured in the same run, paired repeat by repeat.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

# Run as a file, this script's folder heads sys.path, where a module could shadow a
# package or the standard library (elastic/trace.py: `trace`): the repo root goes first.
_REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

SECTIONS = ("mask", "compile", "validity", "served")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    p.add_argument("--quick", action="store_true", help="a short version of each section (a smoke run)")
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the configs' workers use 1)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--batches", default="1,64,256", help="mask: batch sizes of the mask timings")
    p.add_argument("--engine-batch", type=int, default=64)
    p.add_argument("--engine-prompt", type=int, default=32, help="tokens per engine prompt")
    p.add_argument("--engine-steps", type=int, default=16, help="decode steps timed per round")
    p.add_argument("--engine-rounds", type=int, default=4)
    p.add_argument("--config", default="configs/local.yaml", help="served: the cluster to start")
    p.add_argument("--port", type=int, default=8123, help="served: the router's port")
    p.add_argument("--requests", type=int, default=32, help="served: requests per run")
    p.add_argument("--prompt-words", type=int, nargs=2, default=[60, 100], metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--served-rounds", type=int, default=4)
    p.add_argument("--json-share", type=float, default=0.5)
    p.add_argument("--json", dest="json_path", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    args.sections = [s for s in args.only.split(",") if s]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        p.error(f"--only: unknown section(s) {unknown}; known: {', '.join(SECTIONS)}")
    if args.quick:
        args.repeats, args.batches = 1, "1,4"
        args.engine_batch, args.engine_prompt, args.engine_steps, args.engine_rounds = 2, 8, 2, 1
        args.requests, args.prompt_words, args.max_tokens, args.served_rounds = 8, [60, 80], 8, 1
    return args


def _plain(value: object) -> object:
    """The figures as JSON (a Stat as its median, min, max)."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    iters = 3 if args.quick else 15
    report: dict = {"threads": args.threads, "quick": args.quick}
    if "mask" in args.sections:
        from benchmarks.offline.structured_bench.common import Grammars
        from benchmarks.offline.structured_bench.engine_step import engine_steps, print_engine
        from benchmarks.offline.structured_bench.mask import fill_by_position, mask_costs, print_mask

        grammars = Grammars(args.model)
        try:
            batches = [int(b) for b in args.batches.split(",")]
            report["mask"] = mask_costs(grammars, batches, args.repeats, iters)
            report["fill_by_position"] = fill_by_position(grammars, 1 if args.quick else 3, 16 if args.quick else 1)
            print_mask(report["mask"], report["fill_by_position"])
            params = grammars.params
        finally:
            grammars.close()
        report["engine"] = engine_steps(args.model, args.engine_batch, args.engine_prompt, args.engine_steps,
                                        args.engine_rounds, args.threads, params)
        print_engine(report["engine"])
    if "compile" in args.sections:
        from benchmarks.offline.structured_bench.compile_time import compile_times, print_compile

        report["compile"] = compile_times(args.model, args.repeats, 5 if args.quick else 100)
        print_compile(report["compile"])
    if "validity" in args.sections:
        from benchmarks.offline.structured_bench.validity import print_validity, validity

        report["validity"] = validity(args.model, 2 if args.quick else 50, 16 if args.quick else 96)
        print_validity(report["validity"])
    if "served" in args.sections:
        from benchmarks.offline.structured_bench.served import print_served, served

        report["served"] = served(args.config, args.port, args.requests, tuple(args.prompt_words),
                                  args.max_tokens, args.served_rounds, args.json_share)
        print_served(report["served"])
    sys.stdout.flush()
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(_plain(report), indent=1))
    return report


if __name__ == "__main__":
    main()
