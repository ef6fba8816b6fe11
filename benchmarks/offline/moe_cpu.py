"""Mixture of experts on CPU: expert parallelism against TP slicing at 2 ranks, and the
size of MLA's latent KV cache against a dense cache of the same width.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.offline moe_cpu              # ~8 min on 2 cores
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.offline moe_cpu --rounds 1 --steps 3   # smoke

The MoE model: Mixtral's layout, hidden 1024, 4 layers, 16 query / 4 KV heads of 64,
8 experts of intermediate 1408 (DeepSeek-V2-Lite's expert width), top 2, the dense
demo's vocabulary (49152) and tokenizer, generated weights (load_format dummy), float32.
Three engines alive at once, measured in turn (order flipped every round), as
benchmarks/offline/tp_cpu.py measures dense TP (its decode/prefill/collective timers
are reused):

  TP1x2t   one rank, 2 threads: the baseline
  TP2x1t   2 ranks of 1 thread, every expert's intermediate dimension sliced in two
  EP2x1t   2 ranks of 1 thread, expert parallel: each rank holds 4 whole experts

First greedy tokens of both 2-rank engines are checked equal to TP 1's. Per round:
decode ms per step at B = 32, 8, 1 and rank 0's ms per step in all-reduces (pdserve's
expert parallelism has no all-to-all: attention is tensor-parallel, so every rank holds
every token, and the combine is the layer's all-reduce; docs/architecture.md), and
prefill tokens per second.

Then the latent cache: bytes per token and layer the engine allocates (its KV cache
tensor over its slots) for DeepSeek-V2-Lite's and DeepSeek-V3's attention shapes
against a multi-head dense cache of the same width (heads x hidden / heads), each built
with 1 layer, a 1024-token vocabulary and generated weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.offline.tp_cpu import (  # noqa: E402
    DEMO,
    TOKENIZER_FILES,
    VOCAB,
    Config,
    check_tokens,
    close_configs,
    parse_rounds,
    rank0_bytes,
    round_blocks,
    round_parser,
    run_rounds,
)
from engine import LLM  # noqa: E402


def model_dir(out: Path, config: dict[str, Any]) -> Path:
    """A model directory of config.json and the demo's tokenizer (weights: load_format dummy)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2,
                                                 "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                                                 "tie_word_embeddings": False, **config}))
    for name in TOKENIZER_FILES:
        if (DEMO / name).exists():
            shutil.copy(DEMO / name, out / name)
    return out


MOE = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 1024,
       "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
       "head_dim": 64, "num_local_experts": 8, "num_experts_per_tok": 2}
# (name, attention config): DeepSeek-V2-Lite's and V3's latent shapes, dense MHA of each width.
LATENT_SHAPES = [
    ("DeepSeek-V2-Lite", {"hidden_size": 2048, "num_attention_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None}),
    ("DeepSeek-V3", {"hidden_size": 7168, "num_attention_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536}),
]


class DummyConfig(Config):
    def start(self, num_kv_blocks: int) -> None:
        self.llm = LLM(self.model, tensor_parallel_size=self.tp, num_threads=self.threads, load_format="dummy",
                       enable_prefix_caching=False, num_kv_blocks=num_kv_blocks,
                       enable_expert_parallel=self.label.startswith("EP"))


def latent_bytes(tmp: Path) -> list[tuple[str, int, int]]:
    """(shape, latent bytes per token and layer, dense MHA bytes per token and layer of the
    same width), as the engine allocates them (float32, 1 layer)."""
    rows = []
    for name, attn in LATENT_SHAPES:
        hidden, heads = attn["hidden_size"], attn["num_attention_heads"]
        common = {"num_hidden_layers": 1, "intermediate_size": 256, "vocab_size": 1024, **attn}
        mla = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 0, "moe_intermediate_size": 256,
               "num_key_value_heads": heads, **common}
        dense = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_key_value_heads": heads,
                 "head_dim": hidden // heads, **common}
        sizes = []
        for kind, cfg in (("mla", mla), ("dense", dense)):
            llm = LLM(str(model_dir(tmp / f"{name}-{kind}", cfg)), load_format="dummy", num_kv_blocks=4)
            sizes.append(rank0_bytes(llm.core)[1])
            llm.core.close()
        rows.append((name, *sizes))
    return rows


def main() -> None:
    args = parse_rounds(round_parser(__doc__))
    print(f"load average before: {os.getloadavg()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="moe_cpu_"))
    configs: list[Config] = []
    same = True
    try:
        model = str(model_dir(tmp / "moe", MOE))
        configs = [DummyConfig("TP1x2t", model, 1, 2), DummyConfig("TP2x1t", model, 2, 1),
                   DummyConfig("EP2x1t", model, 2, 1)]
        blocks = round_blocks(args)
        memory = {}
        for cfg in configs:
            start = time.perf_counter()
            cfg.start(blocks)
            memory[cfg.label] = rank0_bytes(cfg.core)[0]
            print(f"started {cfg.label} in {time.perf_counter() - start:.1f} s", flush=True)
        torch.set_num_threads(2)
        same = check_tokens(configs[0], configs[1]) & check_tokens(configs[0], configs[2])
    except BaseException:
        close_configs(configs)
        raise
    results = run_rounds(configs, args)  # and closes them
    latent = latent_bytes(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average after: {os.getloadavg()}")
    report(results, configs, memory, latent, args)
    if not same:
        sys.exit("greedy tokens differed between the engines (printed above)")


def report(results: dict[str, dict[str, list[float]]], configs: list[Config], memory: dict[str, int],
           latent: list[tuple[str, int, int]], args: argparse.Namespace) -> None:
    med = {name: {k: statistics.median(v) for k, v in res.items()} for name, res in results.items()}
    bs = sorted(args.batches)
    print(f"\nmedians of {args.rounds} rounds (each a median of {args.steps} steps)")
    print("| engine | rank 0 weights MiB | " + " | ".join(f"decode B={b} ms/step (all-reduce ms)" for b in bs)
          + " | prefill tok/s |")
    print("|---|---:|" + "---:|" * (len(bs) + 1))
    for cfg in configs:
        m = med[cfg.label]
        cells = [f"{m[f'decode B={b} step']:.1f} ({m[f'decode B={b} all-reduce']:.2f})" for b in bs]
        print(f"| {cfg.label} | {memory[cfg.label] / 2**20:.0f} | " + " | ".join(cells)
              + f" | {m['prefill tok/s']:.0f} |")
    print("\nKV cache bytes per token and layer, float32, as allocated:")
    print("| attention shape | MLA latent | dense MHA, same width | ratio |\n|---|---:|---:|---:|")
    for name, mla, dense in latent:
        print(f"| {name} | {mla} | {dense} | {mla / dense:.3f} |")


if __name__ == "__main__":
    main()
