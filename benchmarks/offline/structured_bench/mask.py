"""Mask cost on CPU: filling and applying grammar bitmasks at batch 1, 64 and 256, and
what they add to the sampler, measured against the unconstrained sampler in the same run."""

from __future__ import annotations

import torch
import xgrammar as xgr

from benchmarks.offline.structured_bench.common import Grammars
from benchmarks.offline.structured_bench.stats import Stat, per_call, ratios
from engine.sampling.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from engine.structured.bitmask import BitmaskBuffer


def mask_costs(grammars: Grammars, batches: list[int], repeats: int, iters: int) -> list[dict]:
    """Per batch: ms per step of fill, apply, BitmaskBuffer.apply (both), logits.clone(),
    and the sampler with every row constrained vs none (greedy, same logits)."""
    vocab = grammars.vocab
    words = (vocab + 31) // 32
    rows_out = []
    for batch in batches:
        states = grammars.spread_states(batch)
        rows = list(range(batch))
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch))
        mask = torch.empty((batch, words), dtype=torch.int32)
        buffer = BitmaskBuffer()

        def fill() -> None:
            for state, row in zip(states, rows):
                state.fill(mask, row)

        fill()
        target = logits.clone()
        params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
        plain = [SamplingRow(params, [1], [], None) for _ in rows]
        constrained = [SamplingRow(params, [1], [], None, grammar=s) for s in states]
        sampler = Sampler(grammars.model_config.eos_token_ids)
        timings = {
            "fill": per_call(fill, repeats, iters),
            "apply": per_call(lambda: xgr.apply_token_bitmask_inplace(target, mask, vocab_size=vocab,
                                                                      indices=rows), repeats, iters),
            "fill+apply": per_call(lambda: buffer.apply(target, states, rows), repeats, iters),
            "clone": per_call(lambda: logits.clone(), repeats, iters),
        }
        # The two sampler cases alternate within each repeat, so each pair sees the same machine.
        plain_s, constrained_s = [], []
        for _ in range(repeats):
            plain_s += per_call(lambda: sampler(logits, plain), 1, iters).samples
            constrained_s += per_call(lambda: sampler(logits, constrained), 1, iters).samples
        timings["sampler, none"] = Stat(plain_s)
        timings["sampler, all"] = Stat(constrained_s)
        rows_out.append({"batch": batch, "ms": timings,
                         "sampler_added": Stat([c - p for c, p in zip(constrained_s, plain_s)]),
                         "sampler_ratio": ratios(constrained_s, plain_s)})
    return rows_out


def fill_by_position(grammars: Grammars, repeats: int, stride: int = 1) -> Stat:
    """Seconds of one row's fill at every stride-th position of the document (batch 1):
    the spread is the positions' (a forced key is cheap, the start of a free string is not)."""
    mask = torch.empty((1, (grammars.vocab + 31) // 32), dtype=torch.int32)
    samples = []
    for position in range(0, len(grammars.document) + 1, stride):
        state = grammars.state_at(position)
        samples.append(per_call(lambda: state.fill(mask, 0), repeats, 5).median)
    return Stat(samples)


def print_mask(results: list[dict], by_position: Stat) -> None:
    print("\n### Mask cost per step (ms; median over repeats, min-max in brackets)\n")
    names = list(results[0]["ms"])
    print("| batch | " + " | ".join(names) + " | sampler all - none | sampler all / none |")
    print("|---:|" + "---:|" * (len(names) + 2))
    for r in results:
        cells = [r["ms"][n].show(1e3, 3) for n in names]
        print(f"| {r['batch']} | " + " | ".join(cells) + f" | {r['sampler_added'].show(1e3, 3)} | "
              f"{r['sampler_ratio'].show(1, 2)} |")
    print(f"\nOne row's fill over the {len(by_position.samples)} positions of the document: median "
          f"{by_position.median * 1e6:.1f} us, min {min(by_position.samples) * 1e6:.1f}, "
          f"max {max(by_position.samples) * 1e6:.1f}")
