"""Offline throughput: pdserve `LLM.generate` vs Hugging Face `generate`, and the compute floor.

One seeded workload of random-token prompts runs, in the same process on the same machine,
through pdserve's offline LLM and through transformers' `model.generate`; the machine's
fp32 matmul rate is measured alongside, which turns the workload's useful FLOPs into a
compute floor (the seconds it would take at that rate with zero overhead).

    .venv/bin/python -m benchmarks.offline offline_throughput --model models/SmolLM2-135M-Instruct
    .venv/bin/python -m benchmarks.offline offline_throughput --model models/SmolLM2-135M-Instruct \\
        --num-requests 8 --prompt-len 32 64 --output-len 8 16 --hf-batch-sizes 4,8

Workload: request i has a prompt of uniform [prompt MIN, MAX] random token ids drawn from
[100, vocab-100) (no special ids) and an output length uniform in [output MIN, MAX]; it runs
with SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True), so every request
generates exactly out_len tokens. Output tok/s = generated tokens / wall seconds; total tok/s
counts prompt + output tokens.

HF baseline: requests in arrival order, chunked into batches, left-padded with token 0 and an
attention mask, generate(max_new_tokens = min_new_tokens = the batch's largest out_len,
do_sample=False). Only each request's requested out_len tokens count as output: the padding
and the tokens past a request's own out_len are waste, as they would be for a user. Every
--hf-batch-sizes candidate is timed; the best (output tok/s) is reported.

Compute floor: useful FLOPs per request (P prompt, O output tokens; T = P + O - 1 tokens go
through the model) = 2 * non-embedding linear params * T
                   + 4 * layers * heads * head_dim * sum_{ctx=1..T} ctx   (QK^T and PV)
                   + 2 * hidden * vocab * O                               (lm_head, sampled tokens)
divided by the measured rate of a model-shaped fp32 torch.mm (1024x576 @ 576x1536 for the
demo model: tokens x hidden @ hidden x intermediate). "% of floor" = floor seconds / seconds.

Timings exclude model loading and a short untimed warmup. Each of the --repeats runs of
pdserve uses a fresh LLM, so nothing of an earlier run is in its prefix cache.

Layout: this file measures; benchmarks/offline/throughput/ holds the parts (args.py the command line,
workload.py the prompts, pdserve_run.py and hf_run.py the two engines, timing.py the
matmul rate, flops.py the useful FLOPs, report.py the printout and the JSON).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

# Runnable as a script from anywhere: the repo root holds the `engine` package.
_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.offline.throughput.args import log, parse_args  # noqa: E402
from benchmarks.offline.throughput.flops import read_model_config, workload_flops  # noqa: E402
from benchmarks.offline.throughput.hf_run import run_hf  # noqa: E402
from benchmarks.offline.throughput.pdserve_run import run_pdserve  # noqa: E402
from benchmarks.offline.throughput.report import Results, print_report, write_json  # noqa: E402
from benchmarks.offline.throughput.timing import matmul_gflops, median  # noqa: E402
from benchmarks.offline.throughput.workload import make_workload  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__)
    mc = read_model_config(args.model)
    vocab = mc["vocab_size"]
    prompts, out_lens = make_workload(args, vocab)
    dtype = getattr(torch, args.dtype)
    threads = torch.get_num_threads()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    # Matmul rate: measured before and after the engines (the machine may be shared);
    # the median of all trials is used.
    model_shape = (1024, mc["hidden_size"], mc["intermediate_size"])
    square_shape = (1024, 1024, 1024)
    log(args, f"[floor] timing torch.mm {model_shape} and {square_shape} ({args.dtype}, {threads} threads) ...")
    mm_model = matmul_gflops(*model_shape, dtype, args.device)
    mm_square = matmul_gflops(*square_shape, dtype, args.device)

    pd = run_pdserve(args, prompts, out_lens, vocab)

    hf = None
    hf_n = len(prompts)
    if not args.skip_hf:
        hf_n = min(args.hf_requests or len(prompts), len(prompts))
        hf = run_hf(args, prompts[:hf_n], out_lens[:hf_n], vocab)

    mm_model += matmul_gflops(*model_shape, dtype, args.device)
    mm_square += matmul_gflops(*square_shape, dtype, args.device)
    rate = median(mm_model)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    flops = workload_flops(mc, [len(p) for p in prompts], out_lens)
    floor_s = flops["total"] / (rate * 1e9)
    pd["pct_of_floor"] = 100.0 * floor_s / pd["seconds"]
    if hf is not None:
        hf_flops = workload_flops(mc, [len(p) for p in prompts[:hf_n]], out_lens[:hf_n])
        hf["floor_seconds"] = hf_flops["total"] / (rate * 1e9)
        hf["pct_of_floor"] = 100.0 * hf["floor_seconds"] / hf["seconds"]
        pd["ratio_vs_hf"] = pd["output_tok_s"] / hf["output_tok_s"]
        # Informational: are pdserve's greedy tokens the same as HF's on the HF subset?
        same = sum(a == b for a, b in zip(pd["_tokens"][:hf_n], hf["_tokens"]))
        hf["greedy_identical_requests"] = same

    results = Results(args, mc, prompts, out_lens, pd, hf, hf_n, threads, load_before, load_after,
                      model_shape, square_shape, mm_model, mm_square, rate, flops, floor_s)
    print_report(results)
    if args.json_path:
        write_json(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
