"""The model of rows 3-5: a random Llama checkpoint, its prompts, the HF baseline, and
the engine built on it."""

from __future__ import annotations

import gc
import time
from pathlib import Path

from benchmarks.gpu.shapes import Setup
from benchmarks.gpu.timing import sync


def build_model(s: Setup, out_dir: Path, dtype: str, layers: int | None = None,
                hidden: int | None = None, heads: int | None = None) -> Path:
    """A random Llama-3.2-1B-shaped model (or smaller), saved like a Hugging Face checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, heads = hidden or s.hidden, heads or s.heads
    config = LlamaConfig(vocab_size=s.vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers or s.layers, num_attention_heads=heads,
                         num_key_value_heads=heads // (s.heads // s.kv_heads),
                         max_position_embeddings=4096,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(s.device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out_dir)
    del model
    gc.collect()
    return out_dir


def prompts(s: Setup, n: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, s.vocab - 100) for _ in range(length)] for _ in range(n)]


def hf_greedy(model_dir: Path, s: Setup, dtype: str, batch: list[list[int]], new_tokens: int):
    """HF generate on equal-length prompts (no padding); returns (token lists, seconds)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(s.device)
    ids = torch.tensor(batch, device=s.device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)
    model.generate(ids[:, :8], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
    sync(s.device)
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    sync(s.device)
    seconds = time.perf_counter() - start
    del model
    free_memory(s)
    return out[:, ids.shape[1]:].tolist(), seconds


def free_memory(s: Setup) -> None:
    gc.collect()
    if s.device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def make_llm(model_dir: Path, s: Setup, dtype: str, **options):
    from engine import LLM

    if s.device == "cpu":
        options.update(attention_backend=s.cpu_attention_backend, kv_cache_memory_gib=0.25)
    return LLM(model=str(model_dir), dtype=dtype, device=s.device, **options)
