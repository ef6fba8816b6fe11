"""Parallel sampling (n > 1) against n separate requests, in the same run.

    .venv/bin/python -m benchmarks.offline parallel_sampling                  # n=8, 1024-token prompt, 3 repeats
    .venv/bin/python -m benchmarks.offline parallel_sampling --n 8 --prompt-tokens 1024 --repeats 3 --json out.json

One EngineCore (the demo model, float32, CPU, prefix caching on as served), one random
prompt per repeat (a fresh one, so no repeat finds another's prefix cached), sampled
at temperature 1 with ignore_eos:

  group     one request with n sequences (engine/fork_groups.py: the prompt's KV is
            computed once and shared copy-on-write)
  separate  n requests with the same prompt, sent together as a client without n
            would send them (the engine's prefix cache helps only those admitted after
            the first one's blocks are written)

each on an engine with prefix caching on (as served) and on one with it off (where
nothing but the group shares a prompt's KV).

For each: the KV blocks held once every sequence has its first token (prompt KV: the
group holds its shared blocks plus one copied partial block per sequence but one), the
time until every sequence has its first token, and the time to finish max_tokens.
Medians over the repeats, and group / separate ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.config import EngineConfig  # noqa: E402
from engine.engine_core import EngineCore  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

DEMO_MODEL = "models/SmolLM2-135M-Instruct"


def run(core: EngineCore, prompt: list[int], n: int, max_tokens: int, group: bool, tag: str) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=0)
    start = time.perf_counter()
    if group:
        sequences = core.add_request(tag, prompt, SamplingParams(**{**params.__dict__, "n": n})).sequences
    else:
        sequences = [core.add_request(f"{tag}-{i}", prompt, params.child(0)) for i in range(n)]
    first = blocks = None
    while core.has_unfinished():
        core.step()
        if first is None and all(s.output_token_ids for s in sequences):
            first = time.perf_counter() - start
            blocks = core.kv.pool.num_blocks - core.kv.num_free_blocks
    return {"blocks": blocks, "first_tokens_s": first, "total_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEMO_MODEL)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    rows: dict[str, list[dict[str, float]]] = {}
    for caching in (True, False):
        core = EngineCore(EngineConfig(model=args.model, num_threads=args.threads, kv_cache_memory_gib=1.0,
                                       max_num_seqs=max(16, args.n), enable_prefix_caching=caching))
        vocab = core.model_config.vocab_size
        for r in range(args.repeats):
            for kind in ("group", "separate") if r % 2 == 0 else ("separate", "group"):
                name = f"{kind}, prefix caching {'on' if caching else 'off'}"
                prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
                rows.setdefault(name, []).append(run(core, prompt, args.n, args.max_tokens, kind == "group",
                                                     f"{kind}{r}"))
                print(name, r, rows[name][-1], flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in rows.items()}
    prompt_blocks = -(-args.prompt_tokens // core.config.block_size)
    print(f"\nn={args.n}, {args.prompt_tokens}-token prompt ({prompt_blocks} blocks of {core.config.block_size}), "
          f"max_tokens {args.max_tokens}, medians of {args.repeats}\n")
    print("| prefix caching | | group (n) | separate | group / separate |\n|---|---|---:|---:|---:|")
    for caching in ("on", "off"):
        group, separate = med[f"group, prefix caching {caching}"], med[f"separate, prefix caching {caching}"]
        for metric, unit in (("blocks", "KV blocks held at first tokens"),
                             ("first_tokens_s", "time to every first token, s"), ("total_s", "time to finish, s")):
            g, sep = group[metric], separate[metric]
            print(f"| {caching} | {unit} | {g:.3g} | {sep:.3g} | {g / sep:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": rows,
                                         "medians": med}, indent=1))


if __name__ == "__main__":
    main()
