"""The HF baseline: the workload through transformers' generate in left-padded
arrival-order batches, at each candidate batch size."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.offline.throughput.args import log
from benchmarks.offline.throughput.timing import median, sync
from benchmarks.offline.throughput.workload import warmup_prompts


def hf_generate_all(model: Any, prompts: list[list[int]], out_lens: list[int], batch_size: int,
                    device: str, eos_ids: list[int], progress: str | None = None) -> tuple[list[list[int]], int]:
    """Arrival-order batches, left-padded with 0; returns (useful tokens per request, tokens
    generated). `progress`: the description of a bar (stderr) of the requests done, batch
    by batch; None: no bar."""
    results: list[list[int]] = []
    generated = 0
    bar = tqdm(total=len(prompts), desc=progress, unit="req", file=sys.stderr, disable=progress is None)
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
        bar.update(len(batch))
    bar.close()
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
                tokens, generated = hf_generate_all(model, prompts, out_lens, bs, args.device, eos_ids,
                                                    None if args.quiet else f"hf batch size {bs}")
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
