"""Mixed local/global models (Gemma 2, Gemma 3): the KV a sequence holds with one block
table sized by the global layers (pdserve), against a pool per layer kind (vLLM's hybrid
allocator), on the engine's own KVCacheManager:

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.offline window_pools     # ~15 s on 2 cores

Allocator level only: no model runs and no KV is written. Arm 1 is what the engine
builds: one KVCacheManager whose sliding_window is release_window(config), 0 for a mixed
model, so a block holds every layer and none is released before the sequence ends.
Arm 2 is two KVCacheManagers stepped on the same requests: one with sliding_window=0 for
the full layers (a block holds n_full layers), one with the model's window for the
sliding layers (a block holds n_sliding layers, released as the window passes it).
Both are driven as engine/scheduler.py and engine/scheduler_update.py drive the real one
(allocate_slots, then cache_computed_blocks and release_out_of_window after each step,
free at the end), synchronous steps of at most --step-tokens tokens. Block counts are
exact; bytes are blocks x bytes per block of each arm (bfloat16 unless --dtype float32).

Per model and total length T in 1, 2, 4, 8 x the window, two schedules: a 64-token
prompt decoded up to T, and a T-token prompt then 64 decoded. Reported: the peak blocks
held while a step runs, as bytes, the ratio, the closed form; and how many such
sequences fit in a fixed budget (--budget-blocks arm-1 blocks) in each arm, arm 2 with
a fixed split of the budget chosen for that T, checked by running that many at once
(and one more, which must not fit), and each split reused at every other T.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from engine.kv_cache.manager import KVCacheManager  # noqa: E402
from engine.kv_cache.window import cdiv  # noqa: E402
from engine.model.config import ModelConfig, release_window  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

BLOCK = 16
SHORT = 64  # the short prompt, and the tokens decoded after a long one
MULTIPLES = (1, 2, 4, 8)
GEMMA3_DIR = _REPO_ROOT / "models" / "gemma-3-270m"
# google/gemma-3-270m's config.json, the fields read here (used when the model is not prepared).
GEMMA3_270M = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144, "hidden_size": 640,
               "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
               "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512, "_sliding_window_pattern": 6,
               "max_position_embeddings": 32768, "hidden_activation": "gelu_pytorch_tanh"}
# google/gemma-2-2b's config.json: no layer_types, so transformers' default (alternating).
GEMMA2_2B = {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 256000, "hidden_size": 2304,
             "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096, "max_position_embeddings": 8192,
             "hidden_activation": "gelu_pytorch_tanh"}


@dataclass(frozen=True)
class Shape:
    """What the allocator arms need of a model, read through engine/model/config.py."""

    name: str
    layers: int
    n_full: int
    n_sliding: int
    window: int  # the sliding layers' window (arm 2's sliding pool)
    arm1_window: int  # release_window(config): the engine's one manager's sliding_window
    kv_heads: int
    head_dim: int
    max_context: int
    budget_blocks: int  # arm-1 blocks in the capacity budget

    def layer_block_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one layer's K and V for one block."""
        return 2 * self.kv_heads * self.head_dim * BLOCK * dtype_bytes


def shape_of(name: str, cfg: dict, budget_blocks: int) -> Shape:
    mc = ModelConfig.from_dict(cfg)
    windows = [mc.layer_window(i) for i in range(mc.num_layers)]
    sliding = [w for w in windows if w]
    if not sliding or len(sliding) == len(windows) or len(set(sliding)) != 1:
        raise ValueError(f"{name}: not a mixed model with one window: {windows}")
    return Shape(name, mc.num_layers, windows.count(0), len(sliding), sliding[0], release_window(mc),
                 mc.num_kv_heads, mc.head_dim, mc.max_position_embeddings, budget_blocks)


class NoRoom(Exception):
    pass


def make_requests(n: int, prompt: int, total: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"s{i}", [rng.randrange(2, 30000) for _ in range(prompt)],
                    SamplingParams(max_tokens=total - prompt, temperature=0.0, ignore_eos=True))
            for i in range(n)]


def drive(managers: list[KVCacheManager], requests: list[Request], chunk: int) -> list[int]:
    """Step the requests to their end through every manager, as the scheduler does with
    synchronous steps: each request at most `chunk` tokens a step (and the managers'
    chunk_limit), all in lockstep (one request: an engine with max_num_batched_tokens
    = chunk); every manager sees the same steps. Returns each manager's peak of blocks
    held by all the requests while a step runs (after allocate_slots, before the
    update's releases). NoRoom if a manager cannot give a step its blocks."""
    peaks = [0] * len(managers)
    running = list(requests)
    rng = random.Random(1)
    while running:
        scheduled = []
        limit = min(chunk, *(m.chunk_limit() for m in managers))
        for r in running:
            n = min(r.num_tokens - r.num_computed_tokens, limit)
            for m in managers:
                if not m.allocate_slots(r, n):
                    raise NoRoom(f"{r.request_id} at {r.num_computed_tokens} tokens: {m.num_free_blocks} free")
            r.num_scheduled_tokens += n
            scheduled.append((r, n))
        for i, m in enumerate(managers):
            peaks[i] = max(peaks[i], sum(m.num_held_blocks(r.request_id) for r in running))
        for r, n in scheduled:
            r.num_scheduled_tokens -= n
            r.num_computed_tokens += n
            done = False
            if r.num_computed_tokens == r.num_tokens:  # the step sampled its next token
                r.append_output_token(rng.randrange(2, 30000))
                done = r.num_output_tokens >= r.sampling_params.max_tokens
            for m in managers:
                if done:
                    m.free(r)
                else:
                    m.cache_computed_blocks(r)
                    m.release_out_of_window(r)
            if done:
                running.remove(r)
    return peaks


def managers(shape: Shape, arm: int, blocks: tuple[int, ...]) -> list[KVCacheManager]:
    """Arm 1: the engine's one manager. Arm 2: the full layers' and the sliding layers'."""
    if arm == 1:
        return [KVCacheManager(blocks[0], BLOCK, sliding_window=shape.arm1_window)]
    return [KVCacheManager(blocks[0], BLOCK, sliding_window=0),
            KVCacheManager(blocks[1], BLOCK, sliding_window=shape.window)]


def schedules(shape: Shape) -> list[tuple[str, int, int, int]]:
    """(label, multiple, prompt tokens, total tokens)."""
    rows = [("64 + decode to T", k, SHORT, k * shape.window) for k in MULTIPLES]
    rows += [("T prompt + 64", k, k * shape.window, k * shape.window + SHORT) for k in MULTIPLES]
    return rows


def split_for(shape: Shape, peak_full: int, peak_sliding: int) -> tuple[int, int, int]:
    """The budget (in layer-blocks: budget_blocks x L) split between arm 2's two pools
    for sequences of these peaks: as many whole sequences as fit, the rest to the full
    pool. Returns (sequences, full-pool blocks, sliding-pool blocks)."""
    budget = shape.budget_blocks * shape.layers
    n = budget // (shape.n_full * peak_full + shape.n_sliding * peak_sliding)
    sliding_blocks = n * peak_sliding
    return n, (budget - shape.n_sliding * sliding_blocks) // shape.n_full, sliding_blocks


def fits(shape: Shape, arm: int, pools: tuple[int, ...], n: int, prompt: int, total: int, step_tokens: int) -> bool:
    try:
        drive(managers(shape, arm, pools), make_requests(n, prompt, total, seed=n), step_tokens)
    except NoRoom:
        return False
    return True


def measure(shape: Shape, dtype_bytes: int, step_tokens: int, confirm: bool) -> list[dict]:
    layer_bytes = shape.layer_block_bytes(dtype_bytes)
    rows = []
    for label, k, prompt, total in schedules(shape):
        # Room for one sequence in either arm, and a chunk_limit above step_tokens.
        big = cdiv(total + 2 * step_tokens + shape.window, BLOCK) + 8
        (arm1,) = drive(managers(shape, 1, (big,)), make_requests(1, prompt, total, 0), step_tokens)
        full, sliding = drive(managers(shape, 2, (big, big)), make_requests(1, prompt, total, 0), step_tokens)
        if arm1 != full:  # both read every block: the same manager, the same counts
            raise AssertionError(f"{shape.name} {label} T={total}: arm 1 held {arm1}, arm 2's full pool {full}")
        bytes1 = arm1 * shape.layers * layer_bytes
        bytes2 = (full * shape.n_full + sliding * shape.n_sliding) * layer_bytes
        t = total
        closed = (shape.n_full * t + shape.n_sliding * min(t, shape.window + BLOCK)) / (shape.layers * t)
        # The sliding pool also holds the step's chunk past the window (a long prompt's).
        chunk = min(prompt, step_tokens) if prompt > SHORT else 0
        closed_chunk = (shape.n_full * t + shape.n_sliding * min(t, shape.window + chunk + BLOCK)) / (shape.layers * t)
        cap1 = shape.budget_blocks // arm1
        cap2, pool_full, pool_sliding = split_for(shape, full, sliding)
        row = {"model": shape.name, "schedule": label, "multiple": k, "prompt": prompt, "total": total,
               "arm1_blocks": arm1, "arm2_full_blocks": full, "arm2_sliding_blocks": sliding,
               "arm1_bytes": bytes1, "arm2_bytes": bytes2, "ratio": bytes2 / bytes1, "closed_form": closed,
               "closed_form_chunk": closed_chunk,
               "capacity_arm1": cap1, "capacity_arm2": cap2, "pool_full": pool_full, "pool_sliding": pool_sliding,
               "sliding_share": shape.n_sliding * pool_sliding / (shape.budget_blocks * shape.layers)}
        if confirm:  # that many at once fit, and one more does not, in each arm
            one, two = (shape.budget_blocks,), (pool_full, pool_sliding)
            row["confirmed"] = all(fits(shape, arm, pools, n + extra, prompt, total, step_tokens) == (extra == 0)
                                   for arm, pools, n in ((1, one, cap1), (2, two, cap2)) for extra in (0, 1))
        rows.append(row)
    return rows


def reuse_matrix(shape: Shape, rows: list[dict], label: str) -> list[list[int]]:
    """[i][j]: sequences of length j that fit at once in arm 2 with the split chosen for
    length i (each sequence at its peak)."""
    mine = [r for r in rows if r["model"] == shape.name and r["schedule"] == label]
    return [[min(a["pool_full"] // b["arm2_full_blocks"], a["pool_sliding"] // b["arm2_sliding_blocks"])
             for b in mine] for a in mine]


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def report(shapes: list[Shape], rows: list[dict], dtype: str, confirm: bool) -> None:
    for shape in shapes:
        lb = shape.layer_block_bytes(2 if dtype == "bfloat16" else 4)
        print(f"\n## {shape.name}: {shape.layers} layers ({shape.n_full} full, {shape.n_sliding} sliding, window "
              f"{shape.window}), KV heads {shape.kv_heads} x head_dim {shape.head_dim}, {dtype}; block {BLOCK}; "
              f"arm 1 block {mib(lb * shape.layers)} MiB, arm 2 blocks {mib(lb * shape.n_full)} (full) + "
              f"{mib(lb * shape.n_sliding)} (sliding) MiB; engine's sliding_window {shape.arm1_window}\n")
        print("| schedule | T | arm 1 blocks | arm 2 blocks full + sliding | arm 1 MiB | arm 2 MiB | arm 2 / arm 1 "
              "| closed form | with the chunk |")
        print("|---|---|---|---|---|---|---|---|---|")
        mine = [r for r in rows if r["model"] == shape.name]
        for r in mine:
            print(f"| {r['schedule']} | {r['total']} ({r['multiple']}x) | {r['arm1_blocks']} | "
                  f"{r['arm2_full_blocks']} + {r['arm2_sliding_blocks']} | {mib(r['arm1_bytes'])} | "
                  f"{mib(r['arm2_bytes'])} | {r['ratio']:.3f} | {r['closed_form']:.3f} | "
                  f"{r['closed_form_chunk']:.3f} |")
        budget = shape.budget_blocks * shape.layers * lb
        print(f"\nCapacity in {shape.budget_blocks} arm-1 blocks ({mib(budget)} MiB): arm 2's fixed split chosen "
              f"for each T{'; checked: that many ran at once, and one more did not fit' if confirm else ''}\n")
        print("| schedule | T | arm 1 sequences | arm 2 sequences | arm 2 / arm 1 | arm 2 split: full + sliding "
              "blocks (sliding share of bytes) |" + (" checked |" if confirm else ""))
        print("|---|---|---|---|---|---|" + ("---|" if confirm else ""))
        for r in mine:
            gain = f"{r['capacity_arm2'] / r['capacity_arm1']:.2f}x" if r["capacity_arm1"] else "-"
            print(f"| {r['schedule']} | {r['total']} | {r['capacity_arm1']} | {r['capacity_arm2']} | {gain} | "
                  f"{r['pool_full']} + {r['pool_sliding']} ({100 * r['sliding_share']:.0f}%) |"
                  + (f" {'yes' if r['confirmed'] else 'NO'} |" if confirm else ""))
        label = "64 + decode to T"
        matrix = reuse_matrix(shape, rows, label)
        ts = [r["total"] for r in mine if r["schedule"] == label]
        print(f"\nArm 2 with the split chosen for one T serving another ({label}; diagonal: the split chosen for "
              "that T; arm 1 in the last row)\n")
        print("| split chosen for | " + " | ".join(f"T={t}" for t in ts) + " |")
        print("|---|" + "---|" * len(ts))
        for t, line in zip(ts, matrix, strict=True):
            print(f"| T={t} | " + " | ".join(map(str, line)) + " |")
        print("| arm 1 (one pool) | " + " | ".join(str(r["capacity_arm1"]) for r in mine if r["schedule"] == label)
              + " |")
        over = [t for t in ts if t > shape.max_context]
        if over:
            print(f"\nT = {', '.join(map(str, over))} exceed {shape.name}'s context ({shape.max_context}): "
                  "allocator shapes only.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--step-tokens", type=int, default=512, help="tokens per step (max_num_batched_tokens)")
    parser.add_argument("--gemma3-budget", type=int, default=1000, help="Gemma 3's budget, in arm-1 blocks")
    parser.add_argument("--gemma2-budget", type=int, default=8000, help="Gemma 2's budget, in arm-1 blocks")
    parser.add_argument("--models", default="gemma3,gemma2")
    parser.add_argument("--no-confirm", action="store_true", help="skip running the capacities at once")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    gemma3 = json.loads((GEMMA3_DIR / "config.json").read_text()) if (GEMMA3_DIR / "config.json").is_file() \
        else GEMMA3_270M
    known = {"gemma3": lambda: shape_of("Gemma 3 270M", gemma3, args.gemma3_budget),
             "gemma2": lambda: shape_of("Gemma 2 2B", GEMMA2_2B, args.gemma2_budget)}
    shapes = [known[m]() for m in args.models.split(",")]
    dtype_bytes = 2 if args.dtype == "bfloat16" else 4
    start = time.perf_counter()
    rows = [r for s in shapes for r in measure(s, dtype_bytes, args.step_tokens, not args.no_confirm)]
    print(f"# KV per sequence: one block table (arm 1) or a pool per layer kind (arm 2); allocator only, "
          f"{args.step_tokens} tokens per step ({time.perf_counter() - start:.0f} s)")
    report(shapes, rows, args.dtype, not args.no_confirm)
    if args.json is not None:
        args.json.write_text(json.dumps({"dtype": args.dtype, "block": BLOCK, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
