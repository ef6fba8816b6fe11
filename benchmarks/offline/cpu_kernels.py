"""pdserve's C kernels for CPU float32 models: the panel linear (vs oneDNN and plain
F.linear) and the layer ops (residual add + RMSNorm, rotary, SiLU-and-mul, vs torch ops).

    .venv/bin/python -m benchmarks.offline cpu_kernels                     # 1 thread, ~3 minutes
    .venv/bin/python -m benchmarks.offline cpu_kernels --threads 2 --rows 1,16,512
    .venv/bin/python -m benchmarks.offline cpu_kernels --attention --repeats 15

Tables, each a median over interleaved repeats (this machine's speed drifts):

  layers   one forward's worth of the model's linears (every layer's qkv, o, gate_up,
           down, and the lm_head once), ms per forward and the weight bytes it streams
           per second, for each row count (decode batches to prefill chunks)
  engine   the engine's decode step (EngineCore.step, B requests of ~100-token
           prompts, greedy): oneDNN linears with torch's layer ops (before these
           kernels), panel linears with torch's ops, panel linears with the C ops; steps
           of the three alternate (--skip-engine to leave it out)
  attention  the C decode-attention kernel over every layer of one decode step, on
           the engine's cache layout and on the same K/V with the heads inside the
           layers (the engine's previous layout), alternating (--attention to run it)

The shapes are the model's (default: the demo model, SmolLM2-135M).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.model import cpu_linear  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402


def model_linears(cfg: ModelConfig) -> list[nn.Linear]:
    """Random linears with one forward's shapes: num_layers x (qkv, o, gate_up, down) + lm_head."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = [(cfg.hidden_size, q + 2 * kv), (q, cfg.hidden_size), (cfg.hidden_size, 2 * cfg.intermediate_size),
              (cfg.intermediate_size, cfg.hidden_size)] * cfg.num_layers + [(cfg.hidden_size, cfg.vocab_size)]
    return [nn.Linear(i, o, bias=False) for i, o in shapes]


def interleaved_medians(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    for fn in fns.values():
        fn()  # warm-up: page in the weights, build the kernel
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def layers_table(cfg: ModelConfig, rows_list: list[int], repeats: int) -> None:
    linears = model_linears(cfg)
    forms: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "F.linear": [lambda x, w=lin.weight: F.linear(x, w) for lin in linears]}
    if torch.backends.mkldnn.is_available():
        forms["oneDNN"] = list(map(cpu_linear.PackedLinear, linears))
    if cpu_linear.panel_kernel() is not None:
        forms["panel (C)"] = list(map(cpu_linear.PanelLinear, linears))
    weight_gb = sum(lin.weight.numel() for lin in linears) * 4 / 1e9
    print(f"\none forward's linears ({len(linears)}, {weight_gb:.2f} GB of fp32 weights), "
          f"{torch.get_num_threads()} thread(s), median of {repeats}: ms (weight GB/s)")
    print("| rows | " + " | ".join(forms) + " | panel vs oneDNN |")
    print("|---:|" + "---:|" * (len(forms) + 1))
    for rows in rows_list:
        x = {lin.in_features: torch.randn(rows, lin.in_features) for lin in linears}

        fns = {name: (lambda layers=layers, shapes=linears: [f(x[s.in_features]) for f, s in zip(layers, shapes)])
               for name, layers in forms.items()}
        with torch.inference_mode():
            med = interleaved_medians(fns, repeats)
        cells = [f"{med[n] * 1e3:.1f} ({weight_gb / med[n]:.1f})" for n in forms]
        ratio = (f"{med['oneDNN'] / med['panel (C)']:.2f}x"
                 if {"oneDNN", "panel (C)"} <= set(med) else "-")
        print(f"| {rows} | " + " | ".join(cells) + f" | {ratio} |")


def engine_table(model: str, batches: list[int], steps: int) -> None:
    from engine.llm import LLM
    from engine.model import llama
    from engine.model.fused_ops import fused_ops
    from engine.sampling_params import SamplingParams

    real_kernel = cpu_linear.panel_kernel
    cpu_linear.panel_kernel = lambda: None  # prepack_linears then picks oneDNN
    onednn = LLM(model, num_threads=torch.get_num_threads(), kv_cache_memory_gib=1.0)
    cpu_linear.panel_kernel = real_kernel
    panel = LLM(model, num_threads=torch.get_num_threads(), kv_cache_memory_gib=1.0)
    no_ops = lambda x: None  # noqa: E731 - the model's torch path
    setups = {"oneDNN + torch ops": (onednn, no_ops), "panel + torch ops": (panel, no_ops),
              "panel + C ops": (panel, fused_ops)}
    print(f"\nengine decode step ({model}), ms, median of {steps} steps each, alternating")
    print("| batch | " + " | ".join(setups) + " | speed-up |")
    print("|---:|" + "---:|" * (len(setups) + 1))
    params = SamplingParams(max_tokens=3 * steps + 2, ignore_eos=True, temperature=0.0)
    for batch in batches:
        prompts = [[100 + i + j for j in range(100)] for i in range(batch)]
        for llm in (onednn, panel):
            requests = [llm.core.add_request(f"{batch}-{i}", p, params) for i, p in enumerate(prompts)]
            while not all(r.num_output_tokens for r in requests):
                llm.core.step()  # the prompts, in chunks under the token budget
        times: dict[str, list[float]] = {name: [] for name in setups}
        for _ in range(steps):
            for name, (llm, ops) in setups.items():
                llama.fused_ops = ops
                t = time.perf_counter()
                llm.core.step()
                times[name].append(time.perf_counter() - t)
        llama.fused_ops = fused_ops
        for llm in (onednn, panel):
            while llm.core.has_unfinished():
                llm.core.step()
        med = [statistics.median(ts) for ts in times.values()]
        print(f"| {batch} | " + " | ".join(f"{m * 1e3:.1f}" for m in med) + f" | {med[0] / med[-1]:.2f}x |")


def attention_table(cfg: ModelConfig, cases: list[tuple[int, int]], repeats: int) -> None:
    from engine.attention import cpu_decode
    from engine.kv_cache.layout import cache_shape, layer_view

    if not cpu_decode.supports(torch.empty(1, 2, 16, cfg.num_kv_heads, cfg.head_dim), cfg.num_heads):
        print("\nthe C decode kernel does not take this model's shapes")
        return
    block_size, scale = 16, cfg.head_dim ** -0.5
    print(f"\nC decode attention, all {cfg.num_layers} layers of one step, ms, median of {repeats}, "
          f"{torch.get_num_threads()} thread(s)")
    print("| batch x context | heads inside layers | engine layout (heads outside) | engine / inside |")
    print("|---|---:|---:|---:|")
    for batch, context in cases:
        per_seq = -(-context // block_size)
        num_blocks = batch * per_seq + 8
        engine = torch.randn(cache_shape(num_blocks, cfg.num_kv_heads, cfg.num_layers, block_size, cfg.head_dim))
        inside = engine.permute(0, 2, 3, 4, 1, 5).contiguous()  # [blocks, layers, 2, bs, H, D]
        tables = torch.randperm(num_blocks)[:batch * per_seq].view(batch, per_seq).to(torch.int32).contiguous()
        lens = torch.full((batch,), context, dtype=torch.int32)
        query, rows = torch.randn(batch, cfg.num_heads, cfg.head_dim), torch.arange(batch)
        layers = {"inside": [inside[:, i] for i in range(cfg.num_layers)],
                  "engine": [layer_view(engine, i) for i in range(cfg.num_layers)]}
        outs = {name: cpu_decode.paged_decode_attention(query, views[1], rows, tables, lens, scale)
                for name, views in layers.items()}
        assert torch.equal(outs["inside"], outs["engine"]), "the layouts' results differ"
        fns = {name: (lambda views=views: [cpu_decode.paged_decode_attention(query, v, rows, tables, lens, scale)
                                           for v in views]) for name, views in layers.items()}
        med = interleaved_medians(fns, repeats)
        print(f"| {batch} x {context} | {med['inside'] * 1e3:.1f} | {med['engine'] * 1e3:.1f} | "
              f"{med['engine'] / med['inside']:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,512")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--attention", action="store_true", help="only the decode-attention layout table")
    p.add_argument("--contexts", default="1x1024,8x768,32x512", help="BATCHxCONTEXT for --attention")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig.from_model_dir(args.model)
    if args.attention:
        cases = [tuple(map(int, c.split("x"))) for c in args.contexts.split(",")]
        attention_table(cfg, cases, args.repeats)
        return
    layers_table(cfg, [int(r) for r in args.rows.split(",")], args.repeats)
    if not args.skip_engine:
        engine_table(args.model, [int(b) for b in args.batches.split(",")], args.steps)


if __name__ == "__main__":
    main()
