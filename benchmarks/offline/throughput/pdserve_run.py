"""The workload through pdserve's offline LLM, a fresh engine per repeat."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from typing import Any

from benchmarks.offline.throughput.args import engine_options, log
from benchmarks.offline.throughput.timing import median, sync
from benchmarks.offline.throughput.workload import warmup_prompts


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
        outs = llm.generate(prompts, params, use_tqdm=not args.quiet)  # a bar of requests done (stderr)
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
