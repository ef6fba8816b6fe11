"""The offline benchmark's seeded workload of random-token prompts."""

from __future__ import annotations

import argparse
import random

TOKEN_ID_MARGIN = 100  # token ids are drawn from [100, vocab - 100): no special/reserved ids


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
