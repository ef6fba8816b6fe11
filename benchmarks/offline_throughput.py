"""Offline throughput: pdserve `LLM.generate` vs Hugging Face `generate`, and the compute floor.

One seeded workload of random-token prompts runs, in the same process on the same machine,
through pdserve's offline LLM and through transformers' `model.generate`; the machine's
fp32 matmul rate is measured alongside, which turns the workload's useful FLOPs into a
compute floor (the seconds it would take at that rate with zero overhead).

    .venv/bin/python benchmarks/offline_throughput.py --model models/SmolLM2-135M-Instruct
    .venv/bin/python benchmarks/offline_throughput.py --model models/SmolLM2-135M-Instruct \\
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
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# Runnable as a script from anywhere: the repo root holds the `engine` package.
_REPO_ROOT = Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

TOKEN_ID_MARGIN = 100  # token ids are drawn from [100, vocab - 100): no special/reserved ids


# --------------------------------------------------------------------------- arguments

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
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
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
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


# --------------------------------------------------------------------------- model facts

def read_model_config(model_dir: str) -> dict[str, Any]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    return {
        "architecture": (cfg.get("architectures") or ["?"])[0],
        "vocab_size": cfg["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": cfg["intermediate_size"],
        "num_layers": cfg["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": cfg.get("num_key_value_heads", heads),
        "head_dim": head_dim,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }


def non_embedding_linear_params(mc: dict[str, Any]) -> int:
    """Weights of the per-layer matmuls (q, k, v, o, gate, up, down); norms are negligible."""
    h, i = mc["hidden_size"], mc["intermediate_size"]
    q = mc["num_heads"] * mc["head_dim"]
    kv = mc["num_kv_heads"] * mc["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    return per_layer * mc["num_layers"]


def workload_flops(mc: dict[str, Any], prompt_lens: list[int], output_lens: list[int]) -> dict[str, float]:
    n_params = non_embedding_linear_params(mc)
    attn_width = mc["num_heads"] * mc["head_dim"]
    dense = attn = lm_head = 0
    for p, o in zip(prompt_lens, output_lens):
        t = p + o - 1  # tokens that go through the model (the last sampled one never does)
        dense += 2 * n_params * t
        attn += 4 * mc["num_layers"] * attn_width * (t * (t + 1) // 2)  # ctx = 1..t
        lm_head += 2 * mc["hidden_size"] * mc["vocab_size"] * o
    return {"non_embedding_linear_params": n_params, "dense": float(dense),
            "attention": float(attn), "lm_head": float(lm_head),
            "total": float(dense + attn + lm_head)}


# --------------------------------------------------------------------------- timing helpers

def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, device: str,
                  trials: int = 7, min_seconds: float = 0.25) -> list[float]:
    """GFLOP/s of torch.mm (m x k @ k x n), one figure per trial of >= min_seconds."""
    gen = torch.Generator().manual_seed(1234)
    a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    with torch.inference_mode():
        for _ in range(3):
            torch.mm(a, b, out=out)
        sync(device)
        rates = []
        for _ in range(trials):
            iters = 0
            start = time.perf_counter()
            while True:
                torch.mm(a, b, out=out)
                iters += 1
                if iters % 4 == 0:
                    sync(device)
                    elapsed = time.perf_counter() - start
                    if elapsed >= min_seconds:
                        break
            rates.append(2.0 * m * k * n * iters / elapsed / 1e9)
    return rates


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def log(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- workload

def make_workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    lo_id, hi_id = TOKEN_ID_MARGIN, vocab - TOKEN_ID_MARGIN
    if hi_id <= lo_id:
        raise SystemExit(f"vocab_size {vocab} is too small for ids in [{lo_id}, {hi_id})")
    rng = random.Random(args.seed)
    prompts, outs = [], []
    for _ in range(args.num_requests):
        p = rng.randint(*args.prompt_len)
        o = rng.randint(*args.output_len)
        prompts.append([rng.randrange(lo_id, hi_id) for _ in range(p)])
        outs.append(o)
    return prompts, outs


def warmup_prompts(vocab: int, seed: int, n: int = 2, length: int = 16) -> list[list[int]]:
    rng = random.Random(f"warmup-{seed}")
    return [[rng.randrange(TOKEN_ID_MARGIN, vocab - TOKEN_ID_MARGIN) for _ in range(length)]
            for _ in range(n)]


# --------------------------------------------------------------------------- pdserve

def run_pdserve(args: argparse.Namespace, prompts: list[list[int]], out_lens: list[int],
                vocab: int) -> dict[str, Any]:
    from engine import LLM, SamplingParams

    opts = engine_options(args)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in out_lens]
    n_prompt, n_out = sum(map(len, prompts)), sum(out_lens)
    runs, config, tokens = [], None, None
    for r in range(args.repeats):
        llm = LLM(args.model, **opts)  # fresh engine: an empty prefix cache every repeat
        config = {k: v for k, v in dataclasses.asdict(llm.config).items()}
        llm.generate(warmup_prompts(vocab, r), SamplingParams(max_tokens=4, temperature=0.0,
                                                              ignore_eos=True), use_tqdm=False)
        sync(args.device)
        log(args, f"[pdserve] run {r + 1}/{args.repeats}: {len(prompts)} requests ...")
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(args.device)
        seconds = time.perf_counter() - start
        got = [len(o.token_ids) for o in outs]
        if got != out_lens:
            bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, out_lens)) if g != w][:5]
            raise RuntimeError(f"pdserve generated the wrong number of tokens (index, got, want): {bad}")
        tokens = [list(o.token_ids) for o in outs]
        runs.append({"seconds": seconds, "output_tok_s": n_out / seconds,
                     "total_tok_s": (n_prompt + n_out) / seconds})
        log(args, f"[pdserve] run {r + 1}: {seconds:.2f} s, {n_out / seconds:.1f} output tok/s")
        del llm, outs
        gc.collect()
    return {"engine": "pdserve", "config": config, "num_requests": len(prompts),
            "prompt_tokens": n_prompt, "output_tokens": n_out, "runs": runs,
            "seconds": median([x["seconds"] for x in runs]),
            "output_tok_s": median([x["output_tok_s"] for x in runs]),
            "total_tok_s": median([x["total_tok_s"] for x in runs]),
            "_tokens": tokens}


# --------------------------------------------------------------------------- HF transformers

def hf_generate_all(model: Any, prompts: list[list[int]], out_lens: list[int], batch_size: int,
                    device: str, eos_ids: list[int]) -> tuple[list[list[int]], int]:
    """Arrival-order batches, left-padded with 0; returns (useful tokens per request, tokens generated)."""
    results: list[list[int]] = []
    generated = 0
    for s in range(0, len(prompts), batch_size):
        batch, lens = prompts[s:s + batch_size], out_lens[s:s + batch_size]
        width, new = max(map(len, batch)), max(lens)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0, eos_token_id=eos_ids or None)
        gen = out[:, width:].cpu()
        if gen.shape[1] != new:
            raise RuntimeError(f"HF generated {gen.shape[1]} tokens for a batch, expected {new}")
        generated += gen.numel()
        results.extend(gen[row, :o].tolist() for row, o in enumerate(lens))
    return results, generated


def run_hf(args: argparse.Namespace, prompts: list[list[int]], out_lens: list[int],
           vocab: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    n_prompt, n_out = sum(map(len, prompts)), sum(out_lens)
    with torch.inference_mode():
        hf_generate_all(model, warmup_prompts(vocab, 0), [4, 4], 2, args.device, eos_ids)
    per_bs = []
    for bs in args.hf_batch_sizes:
        runs, tokens = [], None
        for r in range(args.repeats):
            log(args, f"[hf] batch size {bs}, run {r + 1}/{args.repeats}: {len(prompts)} requests ...")
            sync(args.device)
            start = time.perf_counter()
            with torch.inference_mode():
                tokens, generated = hf_generate_all(model, prompts, out_lens, bs, args.device, eos_ids)
            sync(args.device)
            seconds = time.perf_counter() - start
            runs.append({"seconds": seconds, "output_tok_s": n_out / seconds,
                         "total_tok_s": (n_prompt + n_out) / seconds,
                         "generated_tokens_incl_waste": generated})
            log(args, f"[hf] batch size {bs}, run {r + 1}: {seconds:.2f} s, "
                      f"{n_out / seconds:.1f} useful output tok/s")
        per_bs.append({"batch_size": bs, "runs": runs,
                       "seconds": median([x["seconds"] for x in runs]),
                       "output_tok_s": median([x["output_tok_s"] for x in runs]),
                       "total_tok_s": median([x["total_tok_s"] for x in runs]),
                       "generated_tokens_incl_waste": runs[-1]["generated_tokens_incl_waste"],
                       "_tokens": tokens})
    best = max(per_bs, key=lambda x: x["output_tok_s"])
    del model
    gc.collect()
    return {"engine": "hf_transformers", "num_requests": len(prompts), "prompt_tokens": n_prompt,
            "output_tokens": n_out, "batch_sizes": per_bs, "best_batch_size": best["batch_size"],
            "seconds": best["seconds"], "output_tok_s": best["output_tok_s"],
            "total_tok_s": best["total_tok_s"], "_tokens": best["_tokens"]}


# --------------------------------------------------------------------------- main

def strip_private(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: strip_private(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [strip_private(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mc = read_model_config(args.model)
    vocab = mc["vocab_size"]
    prompts, out_lens = make_workload(args, vocab)
    dtype = getattr(torch, args.dtype)
    n_prompt, n_out = sum(map(len, prompts)), sum(out_lens)
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

    # ------------------------------------------------------------------ report
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
    w = max(len(r[0]) for r in rows + [("engine",)])
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
          f"square 1024^3: {median(mm_square):.1f} GFLOP/s")
    line = f"  pdserve runs at {pd['pct_of_floor']:.1f}% of the floor"
    if hf is not None:
        line += f"; HF at {hf['pct_of_floor']:.1f}%" + (" (of its subset's floor)" if subset else "")
    print(line)
    if hf is not None:
        print(f"greedy check (informational): pdserve and HF tokens identical for "
              f"{hf['greedy_identical_requests']}/{hf_n} requests (HF: left-padded batches, EOS masked "
              f"by min_new_tokens; pdserve: ignore_eos)")

    if args.json_path:
        result = {
            "settings": {k: v for k, v in vars(args).items()},
            "engine_options": engine_options(args),
            "model": mc,
            "machine": {"cpu_count": os.cpu_count(), "torch_threads": threads,
                        "torch": torch.__version__, "platform": platform.platform(),
                        "processor": platform.processor(),
                        "load_average_1min": [load_before, load_after]},
            "workload": {"num_requests": len(prompts), "prompt_tokens": n_prompt,
                         "output_tokens": n_out, "prompt_lens": [len(p) for p in prompts],
                         "output_lens": out_lens},
            "matmul_gflops": {"model_shaped": {"shape": list(model_shape), "trials": mm_model,
                                               "median": rate},
                              "square": {"shape": list(square_shape), "trials": mm_square,
                                         "median": median(mm_square)}},
            "flops": flops, "floor_seconds": floor_s,
            "pdserve": strip_private(pd), "hf": strip_private(hf) if hf is not None else None,
            "hf_subset_requests": hf_n if hf is not None else None,
        }
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {args.json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
