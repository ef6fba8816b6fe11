"""The offline benchmark's command line, the engine options it passes on, and its
progress lines."""

from __future__ import annotations

import argparse
import ast
import sys
from typing import Any


def parse_args(argv: list[str] | None, doc: str) -> argparse.Namespace:
    """The checked arguments; `doc` is the script's docstring (its first paragraph is the
    help's description)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"),
                   help="prompt length, uniform in [MIN, MAX] (default 32 512)")
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
                   help="output length, uniform in [MIN, MAX] (default 16 256)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N], for both engines")
    p.add_argument("--hf-batch-sizes", default="8,16,32",
                   help="comma-separated HF batch sizes to try; the best is reported (default 8,16,32)")
    p.add_argument("--skip-hf", action="store_true", help="do not run the HF baseline")
    p.add_argument("--hf-requests", type=int, default=None,
                   help="run HF only on the first N requests (HF tok/s computed on that subset)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each measurement; medians reported")
    p.add_argument("--json", dest="json_path", default=None, help="write all results to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress lines or bars on stderr")
    eng = p.add_argument_group("pdserve engine options (unset: engine defaults)")
    eng.add_argument("--max-num-batched-tokens", type=int, default=None)
    eng.add_argument("--max-num-seqs", type=int, default=None)
    eng.add_argument("--block-size", type=int, default=None)
    eng.add_argument("--num-kv-blocks", type=int, default=None)
    eng.add_argument("--kv-cache-memory-gib", type=float, default=None)
    eng.add_argument("--attention-backend", default=None)
    eng.add_argument("--no-prefix-caching", action="store_true")
    eng.add_argument("--no-chunked-prefill", action="store_true")
    eng.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                     help="any other EngineConfig field (value parsed as a Python literal), repeatable")
    args = p.parse_args(argv)

    def fail(msg: str) -> None:
        p.error(msg)

    if args.num_requests < 1:
        fail("--num-requests must be >= 1")
    for name in ("prompt_len", "output_len"):
        lo, hi = getattr(args, name)
        if lo < 1 or hi < lo:
            fail(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {lo} {hi}")
    if args.repeats < 1:
        fail("--repeats must be >= 1")
    try:
        args.hf_batch_sizes = sorted({int(x) for x in str(args.hf_batch_sizes).split(",") if x.strip()})
    except ValueError:
        fail(f"--hf-batch-sizes must be comma-separated integers, got {args.hf_batch_sizes!r}")
    if not args.hf_batch_sizes or min(args.hf_batch_sizes) < 1:
        fail("--hf-batch-sizes needs at least one batch size >= 1")
    if args.hf_requests is not None and args.hf_requests < 1:
        fail("--hf-requests must be >= 1")
    return args


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Only the options the user set: everything else stays at the engine's defaults."""
    opts: dict[str, Any] = {"dtype": args.dtype, "device": args.device}
    for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "num_kv_blocks",
                 "kv_cache_memory_gib", "attention_backend"):
        if getattr(args, name) is not None:
            opts[name] = getattr(args, name)
    if args.no_prefix_caching:
        opts["enable_prefix_caching"] = False
    if args.no_chunked_prefill:
        opts["enable_chunked_prefill"] = False
    for item in args.engine_option:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--engine-option expects KEY=VALUE, got {item!r}")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        opts[key.strip()] = value
    return opts


def log(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(msg, file=sys.stderr, flush=True)
