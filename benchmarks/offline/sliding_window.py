"""A sliding-window model generating 4x its window: the KV blocks a sequence holds over
time, and the bytes one remote prefill moves, against the same weights with the window
ignored, in one run:

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.offline sliding_window           # ~1 min on 2 cores
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.offline sliding_window --gemma models/gemma-3-270m

1. Blocks held: one sequence of --prompt tokens generating 4 x --window tokens on a
   Mistral-shaped model with random weights (every layer windowed), sampled after every
   step; and the decode rate over the last window of it. The same model with
   `sliding_window: null` holds every block.
2. Bytes per remote prefill: a prompt of 4 x --window tokens prefilled by one engine and
   pushed into another's cache over shm (real transport, one process), as the prefill
   side counts them (bytes_written), both models; the decoded tokens are checked against
   the colocated engine's.
3. With --gemma DIR (pdserve model prepare gemma3): the real Gemma 3 270M, a prompt past
   its 512 window, greedy float32 tokens against transformers', and its decode rate;
   and the bytes of a remote prefill of 4x its window, a mixed model's (the blocks
   before the window carry the global layers only), against the window ignored.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import torch  # noqa: E402

from benchmarks.offline.one_push import push_one  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import VOCAB_SIZE, train_tokenizer  # noqa: E402

BLOCK = 16


def build_models(root: Path, window: int) -> tuple[Path, Path]:
    """A Mistral-shaped model (4 layers, hidden 256, GQA 4:2, random weights) with every
    layer windowed, and a copy with the window off."""
    from transformers import MistralConfig, MistralForCausalLM

    windowed = root / "windowed"
    tok = train_tokenizer(windowed)
    config = MistralConfig(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                           sliding_window=window, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = MistralForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    model.save_pretrained(windowed)
    full = root / "full"
    shutil.copytree(windowed, full)
    cfg = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}))
    return windowed, full


def blocks_over_time(model: Path, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Blocks the sequence holds after each step, and its decode tokens per second over
    the last quarter of the generation."""
    llm = LLM(str(model), block_size=BLOCK, num_kv_blocks=4 * (len(prompt) + max_tokens) // BLOCK)
    core = llm.core
    core.add_request("s", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    held, times = [], []
    while core.has_unfinished():
        core.step()
        times.append(time.perf_counter())
        held.append(core.kv.num_held_blocks("s"))
    quarter = max_tokens // 4
    rate = quarter / (times[-1] - times[-1 - quarter])
    core.close()
    return held, rate


def remote_prefill_bytes(model: Path, prompt: list[int], **engine: str) -> tuple[int, list[int], list[int]]:
    """(bytes the prefill engine wrote for the prompt over shm, the decoded tokens, the
    colocated engine's); `engine`: more EngineConfig options (dtype)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    written, out = push_one(model, "shm", prompt, params, num_kv_blocks=256, max_num_batched_tokens=256, **engine)
    want = LLM(str(model), num_kv_blocks=256, **engine).generate([prompt], params, use_tqdm=False)[0].token_ids
    return written, out, want


def gemma_rows(model_dir: Path) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = "The quick brown fox jumps over the lazy dog near the river bank, while the sun sets slowly. " * 60
    prompt = tok(text)["input_ids"][:700] + tok(" Question: What is the capital of France?\nAnswer:",
                                                add_special_tokens=False)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                          pad_token_id=0)
    want = ids[0, len(prompt):].tolist()
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=256, block_size=BLOCK)
    start = time.perf_counter()
    got = llm.generate([prompt], SamplingParams(max_tokens=32, min_tokens=32, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0].token_ids
    seconds = time.perf_counter() - start
    return [f"| Gemma 3 270M, {len(prompt)}-token prompt (window 512), float32 | "
            f"{'identical' if got == want else 'DIFFERENT'} to transformers' 32 greedy tokens | "
            f"{seconds:.1f} s for prefill + 32 tokens | {tok.decode(got[:6])!r} |"]


def gemma_push_rows(model_dir: Path, root: Path, tokens: int) -> list[str]:
    """A remote prefill of a `tokens`-token prompt on Gemma 3 270M, a mixed model (a
    window of 512 on 15 of its 18 layers): the blocks before the window carry the 3
    global layers only. Against the same weights with the window ignored (every layer
    global), over shm; the decoded tokens against each one's colocated engine's."""
    ignored = root / "gemma-no-window"
    ignored.mkdir()
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (ignored / f.name).symlink_to(f.resolve())
    cfg = json.loads((model_dir / "config.json").read_text())
    (ignored / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, cfg["vocab_size"] // 2, (tokens,), generator=g).tolist()
    rows, sizes = [], {}
    for name, model in (("Gemma 3 270M", model_dir), ("the same, window ignored", ignored)):
        written, got, want = remote_prefill_bytes(model, prompt, dtype="float32")
        sizes[name] = written
        rows.append(f"| {name} | {written:,} | {got == want} |")
    rows.append(f"\nratio: {sizes['Gemma 3 270M'] / sizes['the same, window ignored']:.3f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="runs of part 1, for the decode rate's median")
    parser.add_argument("--gemma", type=Path, default=None, help="the prepared Gemma 3 270M directory")
    args = parser.parse_args()
    generated = 4 * args.window
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, VOCAB_SIZE, (args.prompt,), generator=g).tolist()
    with tempfile.TemporaryDirectory(prefix="pdserve-window-") as tmp:
        windowed, full = build_models(Path(tmp), args.window)
        print(f"## Blocks held by one sequence ({args.prompt}-token prompt, {generated} generated, window "
              f"{args.window}, block {BLOCK})\n")
        # held[i]: after step i, which samples token i + 1 (the last step finishes the
        # sequence, which then holds nothing: the row stops one before)
        marks = [0] + [k * args.window - 1 for k in range(1, 4)] + [generated - 2]
        print("| model | " + " | ".join(f"after {m + 1} tokens" for m in marks) + " | peak | decode tok/s, "
              f"last quarter (median of {args.rounds}) |")
        print("|---|" + "---|" * 7)
        for name, model in (("windowed", windowed), ("window ignored", full)):
            runs = [blocks_over_time(model, prompt, generated) for _ in range(args.rounds)]
            held = runs[0][0]  # the same every round
            points = [held[m] for m in marks]
            rate = statistics.median(r for _, r in runs)
            print(f"| {name} | " + " | ".join(map(str, points)) + f" | {max(held)} | {rate:.0f} |")
        long_prompt = torch.randint(2, VOCAB_SIZE, (generated,), generator=g).tolist()
        print(f"\n## Bytes per remote prefill ({generated}-token prompt, shm, 1P1D)\n")
        print("| model | bytes written | blocks | decoded tokens = colocated |")
        print("|---|---|---|---|")
        sizes = {}
        for name, model in (("windowed", windowed), ("window ignored", full)):
            written, got, want = remote_prefill_bytes(model, long_prompt)
            sizes[name] = written
            block_bytes = 4 * 2 * 2 * BLOCK * 64 * 4  # layers, K and V, KV heads, slots, head_dim, float32
            print(f"| {name} | {written} | {written // block_bytes} | {got == want} |")
        print(f"\nratio windowed / ignored: {sizes['windowed'] / sizes['window ignored']:.3f}")
    if args.gemma is not None:
        print("\n## A real windowed model\n")
        print("| model | tokens | time | text |")
        print("|---|---|---|---|")
        for row in gemma_rows(args.gemma):
            print(row)
        print(f"\n## Bytes per remote prefill of a mixed model ({4 * 512}-token prompt, shm, 1P1D, float32)\n")
        print("| model | bytes written | decoded tokens = colocated |")
        print("|---|---|---|")
        with tempfile.TemporaryDirectory(prefix="pdserve-gemma-") as tmp:
            for row in gemma_push_rows(args.gemma, Path(tmp), 4 * 512):
                print(row)


if __name__ == "__main__":
    main()
