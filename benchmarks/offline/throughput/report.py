"""The offline benchmark's report: the summary and table it prints, and the JSON file
of every measurement (--json)."""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.offline.throughput.args import engine_options
from benchmarks.offline.throughput.timing import median


@dataclass
class Results:
    """One run's measurements, as offline_throughput.main gathered them."""

    args: argparse.Namespace
    mc: dict[str, Any]  # read_model_config's facts
    prompts: list[list[int]]
    out_lens: list[int]
    pd: dict[str, Any]  # run_pdserve's, with pct_of_floor (and ratio_vs_hf when HF ran)
    hf: dict[str, Any] | None  # run_hf's, with floor_seconds, pct_of_floor, greedy_identical_requests
    hf_n: int  # HF ran the first hf_n requests
    threads: int  # torch's intra-op threads
    load_before: float | None  # 1-min load average; None where the OS has none
    load_after: float | None
    model_shape: tuple[int, int, int]  # (m, k, n) of the model-shaped torch.mm
    square_shape: tuple[int, int, int]
    mm_model: list[float]  # GFLOP/s of every trial, before and after the engines
    mm_square: list[float]
    rate: float  # median(mm_model): the floor's GFLOP/s
    flops: dict[str, float]  # workload_flops of all the requests
    floor_s: float


def strip_private(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: strip_private(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [strip_private(v) for v in obj]
    return obj


def print_report(r: Results) -> None:
    """The run's settings, the engines' table, the compute floor and the greedy check."""
    args, mc, prompts, pd, hf, hf_n = r.args, r.mc, r.prompts, r.pd, r.hf, r.hf_n
    threads, load_before, load_after, flops, rate = r.threads, r.load_before, r.load_after, r.flops, r.rate
    floor_s, model_shape = r.floor_s, r.model_shape
    n_prompt, n_out = sum(map(len, prompts)), sum(r.out_lens)

    subset = hf is not None and hf_n < len(prompts)
    print()
    print(f"offline throughput: {mc['architecture']} at {args.model}, {args.dtype} on {args.device}")
    print(f"workload: {len(prompts)} requests, seed {args.seed}, prompt len U[{args.prompt_len[0]}, "
          f"{args.prompt_len[1]}], output len U[{args.output_len[0]}, {args.output_len[1]}] "
          f"(greedy, ignore_eos): {n_prompt} prompt + {n_out} output tokens")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__} with {threads} threads; repeats {args.repeats}"
          f"{' (medians)' if args.repeats > 1 else ''}"
          + (f"; 1-min load average {load_before:.1f} before, {load_after:.1f} after"
             if load_before is not None else ""))
    if load_before is not None:
        # Load from other work: the 1-minute average (it lags by about a minute, so an earlier
        # run of this script counts too), less this run's own threads at the end.
        other = max(load_before, load_after - threads)
        if other > 1.0:
            print(f"WARNING: the machine looked busy (1-min load average {load_before:.1f} before, "
                  f"{load_after:.1f} after, on {os.cpu_count()} CPUs; this run uses {threads} "
                  f"threads): timings may be unreliable")
    cfg = pd["config"]
    shown = ("max_num_batched_tokens", "max_num_seqs", "block_size", "num_kv_blocks",
             "kv_cache_memory_gib", "enable_prefix_caching", "enable_chunked_prefill",
             "attention_backend")
    print("pdserve: " + ", ".join(f"{k}={cfg[k]}" for k in shown if k in cfg))
    if hf is not None:
        tried = ", ".join(f"bs {b['batch_size']}: {b['output_tok_s']:.1f}" for b in hf["batch_sizes"])
        print(f"HF: batch sizes tried (output tok/s) {tried}; best bs {hf['best_batch_size']}"
              + (f"; run on the first {hf_n} of {len(prompts)} requests (HF tok/s are for that "
                 f"subset; its token mix may differ slightly from the full set)" if subset else ""))
    print()
    rows = [("pdserve", pd["output_tok_s"], pd["total_tok_s"], pd["seconds"],
             f"{pd['ratio_vs_hf']:.2f}x" if hf is not None else "-")]
    if hf is not None:
        name = f"HF transformers (bs {hf['best_batch_size']}" + (f", {hf_n} req)" if subset else ")")
        rows.append((name, hf["output_tok_s"], hf["total_tok_s"], hf["seconds"], "1.00x"))
    w = max(len(row[0]) for row in rows + [("engine",)])
    print(f"{'engine':<{w}} | {'tok/s (output)':>14} | {'tok/s (total)':>13} | {'seconds':>8} | {'vs HF':>6}")
    print(f"{'-' * w}-+-{'-' * 14}-+-{'-' * 13}-+-{'-' * 8}-+-{'-' * 6}")
    for name, o, t, s, ratio in rows:
        print(f"{name:<{w}} | {o:>14.1f} | {t:>13.1f} | {s:>8.2f} | {ratio:>6}")
    print()
    print(f"compute floor: {flops['total'] / 1e9:.1f} GFLOP useful (dense {flops['dense'] / 1e9:.1f}, "
          f"attention {flops['attention'] / 1e9:.1f}, lm_head {flops['lm_head'] / 1e9:.1f}; "
          f"{flops['non_embedding_linear_params'] / 1e6:.1f}M non-embedding params) "
          f"at {rate:.1f} GFLOP/s = {floor_s:.2f} s")
    print(f"  rate = median fp32 torch.mm {model_shape[0]}x{model_shape[1]} @ {model_shape[1]}x"
          f"{model_shape[2]} (model-shaped, used for the floor): {rate:.1f} GFLOP/s; "
          f"square 1024^3: {median(r.mm_square):.1f} GFLOP/s")
    line = f"  pdserve runs at {pd['pct_of_floor']:.1f}% of the floor"
    if hf is not None:
        line += f"; HF at {hf['pct_of_floor']:.1f}%" + (" (of its subset's floor)" if subset else "")
    print(line)
    if hf is not None:
        print(f"greedy check (informational): pdserve and HF tokens identical for "
              f"{hf['greedy_identical_requests']}/{hf_n} requests (HF: left-padded batches, EOS masked "
              f"by min_new_tokens; pdserve: ignore_eos)")


def write_json(r: Results) -> None:
    """Every setting and measurement to args.json_path (engines' private fields dropped)."""
    args, prompts, out_lens, pd, hf = r.args, r.prompts, r.out_lens, r.pd, r.hf
    n_prompt, n_out = sum(map(len, prompts)), sum(out_lens)
    result = {
        "settings": {k: v for k, v in vars(args).items()},
        "engine_options": engine_options(args),
        "model": r.mc,
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": r.threads,
                    "torch": torch.__version__, "platform": platform.platform(),
                    "processor": platform.processor(),
                    "load_average_1min": [r.load_before, r.load_after]},
        "workload": {"num_requests": len(prompts), "prompt_tokens": n_prompt,
                     "output_tokens": n_out, "prompt_lens": [len(p) for p in prompts],
                     "output_lens": out_lens},
        "matmul_gflops": {"model_shaped": {"shape": list(r.model_shape), "trials": r.mm_model,
                                           "median": r.rate},
                          "square": {"shape": list(r.square_shape), "trials": r.mm_square,
                                     "median": median(r.mm_square)}},
        "flops": r.flops, "floor_seconds": r.floor_s,
        "pdserve": strip_private(pd), "hf": strip_private(hf) if hf is not None else None,
        "hf_subset_requests": r.hf_n if hf is not None else None,
    }
    Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    print(f"results written to {args.json_path}")
