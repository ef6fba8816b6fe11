"""The one-shot GPU check: correctness first, then timings, as one short table.

    python benchmarks/gpu_check.py                 # on an H200: about 5 minutes
    python benchmarks/gpu_check.py --smoke         # on CPU, tiny shapes, Triton interpreter:
                                                   # checks this script, not the GPU

Rows 1-5 need only torch, triton, transformers and numpy (what the H200 image has).
Row 6 also needs pyzmq and msgpack (and nixl for its nixl row), carried as cp312 wheels
(see the device README), e.g.:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux2014_x86_64 -d .whl pyzmq==27.3.0 msgpack==1.2.4
    # on the device, carrying .whl:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
        && PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py

Rows:
 1. each Triton kernel against the torch reference in bf16 (relative error <= 1e-2, no NaN)
 2. decode-attention bandwidth: bytes it must read / its time, vs 4.23 TB/s (>= 70% at
    batch 64, context 2k)
 3. engine decode step at batch 64 and 256, context ~1k, vs the memory floor (weights + KV
    bytes at 4.23 TB/s; <= 1.5x at batch 256)
 4. offline throughput of LLM.generate vs HF generate, Llama-3.2-1B-shaped random bf16
    model, 512-token prompts, 128 new tokens (>= 20x)
 5. greedy tokens equal to HF in float32 (exact); in bf16 the fraction that match; CUDA
    graphs vs eager identical
 5b. rows 3 and 4 again with async scheduling (greedy tokens identical to the synchronous
    engine's), and the offline workload again with all its requests in one batch and
    16k-token steps
 6. KV transfer between two processes on the GPU, 256 MiB in 2 MiB descriptors:
    cuda_ipc, and nixl if its wheel came along (>= 150 GB/s)
A failing section prints FAIL with its error and the script goes on to the next.

Diagnostics, not in the default run (helpers in benchmarks/gpu_profile.py):

    # where the GPU time of a decode step at batch 256, context ~1k goes (~1.5 min):
    python3 benchmarks/gpu_check.py --only profile
    # nixl (UCX) GB/s, 256 MiB and 1 GiB, under each UCX setting (<= 3 min; needs the wheels):
    PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py --only ucx
    # both, in one run:
    PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py --only profile,ucx

 profile: torch.profiler (CPU + CUDA activity) over 5 decode steps of the Llama-3.2-1B-shaped
    bf16 model at batch 256, run eagerly and then replaying the CUDA graphs, on one engine:
    the top 15 GPU kernels (ms per step side by side, launches, % of the graph step), the
    sum of all kernel time, the unprofiled wall time of a step and of a graph replay alone,
    and the time per kernel group (attention, gemm, other Triton, torch ops, memcpy/set).
 ucx: benchmarks/kv_transfer.py for nixl alone (2 MiB descriptors, 512 KiB blocks, as row 6)
    in a fresh process per setting (UCX and NIXL read their environment at init; 60 s
    timeout each, 170 s for the section): default; default with UCX_PROTO_INFO (prints the
    lanes and put protocols UCX chose); NIXL_UCX_SGL_ENABLE=y (one UCX request per write);
    UCX_CUDA_IPC_MAX_POLL=1024; NIXL's UCX backend with ucx_error_handling_mode=none (lets
    UCX pick lanes that cannot report a peer's failure: shared memory), alone and with
    UCX_TLS=sm,cuda_ipc,cuda_copy,self; UCX_TLS cuda_ipc,cuda_copy,tcp,self /
    cuda_ipc,cuda_copy,self / sm,cuda_ipc,cuda_copy,self / rc,cuda_copy,cuda_ipc,self;
    UCX_PROTO_ENABLE=n; UCX_RNDV_SCHEME=put_zcopy with UCX_RNDV_THRESH=8192; and SGL,
    MAX_POLL and error mode none together. A setting that fails is a row with UCX's error.
Both also run on CPU with --smoke (tiny model; nixl over DRAM), which checks the code only.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

HBM_BYTES_PER_S = 4.23e12  # H200


@dataclass
class Setup:
    device: str
    dtype: str  # for rows 1-4
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    bw_batch: int
    bw_context: int
    step_batches: tuple[int, ...]
    step_context: int
    requests: int
    prompt_len: int
    new_tokens: int
    hf_batch: int


H200 = Setup("cuda", "bfloat16", 2048, 8192, 16, 32, 8, 128256, 64, 2048, (64, 256), 1024,
             1024, 512, 128, 128)
SMOKE = Setup("cpu", "float32", 64, 128, 2, 4, 2, 512, 2, 64, (2,), 40, 4, 24, 4, 4)

ROWS: list[tuple[str, str, str, str]] = []  # (check, measured, target, verdict)


def row(check: str, measured: str, target: str = "", ok: bool | None = None) -> None:
    verdict = "" if ok is None else ("ok" if ok else "FAIL")
    ROWS.append((check, measured, target, verdict))
    print(f"  {check}: {measured} {target} {verdict}", flush=True)


def section(name: str, fn: Callable[[], None]) -> None:
    print(f"[{name}]", flush=True)
    start = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # one broken section must not hide the others' numbers
        traceback.print_exc()
        row(name, f"{type(exc).__name__}: {exc}"[:120], "", False)
    print(f"  ({time.perf_counter() - start:.1f} s)", flush=True)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], None], device: str, repeats: int) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_seconds(fn: Callable[[], None], device: str, calls: int = 20, repeats: int = 10) -> float:
    """GPU time of one fn() call: `calls` calls captured in a CUDA graph and replayed, so
    the launchers' Python (tens of microseconds, as long as a decode kernel) is not
    timed; in the engine these kernels run inside CUDA graphs too. CPU: wall time."""
    if not device.startswith("cuda"):
        return median_seconds(fn, device, 1)
    import torch

    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_seconds(graph.replay, device, repeats) / calls


# ------------------------------------------------------------------ 1. kernels vs reference

def check_kernels(s: Setup) -> None:
    import torch

    from engine.attention import reference
    from engine.attention.metadata import AttentionMetadata
    from engine.kernels.decode_attention import decode_attention, num_splits_for
    from engine.kernels.prefill_attention import default_config, plan_tiles, prefill_attention
    from engine.kernels.store_kv import store_kv

    dtype = getattr(torch, s.dtype)
    torch.manual_seed(0)
    bs, kv, groups = 16, s.kv_heads, s.heads // s.kv_heads
    for head_dim in (64, 128):
        # (new tokens, context): decodes on and past block boundaries, long decodes
        # that split, fresh prompts, chunks after cached prefixes.
        case = [(1, 1), (1, 16), (1, 17), (1, 700), (1, s.bw_context), (37, 37), (64, 200), (5, 1111)]
        if s.device == "cpu":
            case = [(1, 1), (1, 17), (1, 70), (9, 9), (7, 40)]
        nblocks = [-(-n // bs) for _, n in case]
        cache = torch.full((sum(nblocks) + 4, 2, bs, kv, head_dim), float("nan"), dtype=dtype, device=s.device)
        perm = torch.randperm(cache.shape[0]).tolist()
        tables = torch.zeros((len(case), max(nblocks)), dtype=torch.int32)
        slots_new, ks, vs = [], [], []
        for i, ((q_len, n), nb) in enumerate(zip(case, nblocks)):
            tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
            pos = torch.arange(n)
            slots = (tables[i].long()[pos // bs] * bs + pos % bs).to(s.device)
            k = torch.randn(n, kv, head_dim, device=s.device).to(dtype)
            v = torch.randn(n, kv, head_dim, device=s.device).to(dtype)
            reference.store_kv(cache, k[:n - q_len], v[:n - q_len], slots[:n - q_len])
            slots_new.append(slots[n - q_len:]), ks.append(k[n - q_len:]), vs.append(v[n - q_len:])
        key, value = torch.cat(ks), torch.cat(vs)
        slot_mapping = torch.cat(slots_new)
        expected_cache = cache.clone()
        reference.store_kv(expected_cache, key, value, slot_mapping)
        store_kv(cache, key, value, slot_mapping)
        same = torch.equal(cache.nan_to_num(7.0), expected_cache.nan_to_num(7.0))
        row(f"store_kv d{head_dim}", "bit-exact" if same else "differs", "bit-exact", same)

        q_lens = [q for q, _ in case]
        query = torch.randn(sum(q_lens), kv * groups, head_dim, device=s.device).to(dtype)
        starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        md = AttentionMetadata(slot_mapping, starts.to(s.device),
                               torch.tensor([n for _, n in case], dtype=torch.int32, device=s.device),
                               tables.to(s.device), q_lens, [n for _, n in case])
        expected = reference.paged_attention(query.float(), cache.float(), md, head_dim ** -0.5)
        out = torch.full_like(query, float("nan"))
        decode = [i for i, q in enumerate(q_lens) if q == 1]
        prefill = [i for i, q in enumerate(q_lens) if q > 1]
        index = torch.tensor(decode, device=s.device)
        decode_attention(out, query, cache, starts[decode].to(s.device), md.block_tables[index].contiguous(),
                         md.seq_lens[index].contiguous(), head_dim ** -0.5,
                         num_splits_for(max(case[i][1] for i in decode)))
        tile_seq, tile_start = plan_tiles(q_lens, prefill, default_config(cache.device).block_m)
        prefill_attention(out, query, cache, md.block_tables, md.seq_lens, md.query_start_loc,
                          torch.from_numpy(tile_seq).to(s.device), torch.from_numpy(tile_start).to(s.device),
                          head_dim ** -0.5)
        for name, rows in (("decode", decode), ("prefill", prefill)):
            tokens = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rows]).to(s.device)
            got, ref = out[tokens].float(), expected[tokens]
            err = ((got - ref).norm() / ref.norm()).item()
            ok = not got.isnan().any().item() and err <= 1e-2
            row(f"{name} attention d{head_dim} ({s.dtype})", f"rel err {err:.1e}", "<= 1e-2", ok)
        # The decode rows again with the 8k-context splits of a CUDA graph, shared by every
        # program count: a program looping over splits must give the same bits.
        decode_rows = starts[decode].to(s.device), md.block_tables[index].contiguous(), md.seq_lens[index].contiguous()
        splits = num_splits_for(8192)
        outs = []
        for programs in (splits, 2, 1):
            out = torch.full_like(query, float("nan"))
            decode_attention(out, query, cache, *decode_rows, head_dim ** -0.5, splits, split_programs=programs)
            outs.append(out[decode_rows[0].long()])
        same = all(torch.equal(o, outs[0]) for o in outs[1:]) and not outs[0].isnan().any().item()
        row(f"decode d{head_dim}, {splits} splits: 2 or 1 programs == one per split", "identical" if same
            else "differ", "identical", same)
    check_norm_rope(s)


def check_norm_rope(s: Setup) -> None:
    """The fused norm, rotary and SiLU-and-mul kernels against the model's torch ops."""
    import torch

    from engine.kernels.norm_rope import add_rms_norm, rotary_
    from engine.model.llama import RMSNorm
    from engine.model.rope import RotaryEmbedding, apply_rotary

    dtype, head_dim = getattr(torch, s.dtype), s.hidden // s.heads
    torch.manual_seed(0)
    norm = RMSNorm(s.hidden, 1e-5).to(s.device, dtype)
    norm.weight.data.normal_()
    x, residual = (torch.randn(300, s.hidden, device=s.device).to(dtype) for _ in range(2))
    out, summed = add_rms_norm(x, norm.weight, 1e-5, residual)
    ref = norm(x + residual).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    ok = torch.equal(summed, x + residual) and err <= 1e-2
    row(f"fused add + RMSNorm ({s.dtype})", f"rel err {err:.1e}", "<= 1e-2", ok)
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, None, s.device)
    positions = torch.randint(0, 4096, (300,), device=s.device)
    q = torch.randn(300, s.heads, head_dim, device=s.device).to(dtype)
    k = torch.randn(300, s.kv_heads, head_dim, device=s.device).to(dtype)
    want_q, want_k = apply_rotary(q.float(), k.float(), *rope.lookup(positions, torch.float32))
    rotary_(q, k, rope.cos, rope.sin, positions)
    err = max(((a.float() - b).norm() / b.norm()).item() for a, b in ((q, want_q), (k, want_k)))
    row(f"fused rotary ({s.dtype})", f"rel err {err:.1e}", "<= 1e-2", err <= 1e-2)
    from engine.kernels.activation import silu_and_mul

    gate_up = torch.randn(300, 2 * 4 * s.hidden, device=s.device).to(dtype)  # I = 4 x hidden
    gate, up = gate_up.float().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    err = ((silu_and_mul(gate_up).float() - ref).norm() / ref.norm()).item()
    row(f"fused SiLU-and-mul ({s.dtype})", f"rel err {err:.1e}", "<= 1e-2", err <= 1e-2)


# ------------------------------------------------------------------ 2. decode bandwidth

def check_bandwidth(s: Setup) -> None:
    for head_dim in (64, 128):
        seconds, nbytes = decode_bandwidth(s, head_dim)
        pct = 100 * nbytes / seconds / HBM_BYTES_PER_S
        row(f"decode kernel bandwidth b{s.bw_batch} ctx{s.bw_context} d{head_dim}",
            f"{nbytes / seconds / 1e12:.2f} TB/s ({pct:.0f}%, {seconds * 1e6:.0f} us)", ">= 70%", pct >= 70)
    b, ctx = max(s.step_batches), s.step_context
    seconds, nbytes = decode_bandwidth(s, s.hidden // s.heads, batch=b, context=ctx)
    row(f"decode kernel b{b} ctx{ctx} d{s.hidden // s.heads} (the model's)",
        f"{seconds * 1e6:.0f} us x {s.layers} layers = {seconds * s.layers * 1e3:.2f} ms, "
        f"{100 * nbytes / seconds / HBM_BYTES_PER_S:.0f}%", "(info)")
    # A CUDA graph launches the splits of the longest context it serves (engine/cuda_graphs.py):
    # 16 for ~1k contexts here. Timed with the launcher's programs per (sequence, KV head),
    # which loop over the splits at this batch, and with one program per split.
    import torch

    from engine.cuda_graphs import MAX_CONTEXT
    from engine.kernels.decode_attention import num_splits_for, split_programs_for

    graph_splits = num_splits_for(MAX_CONTEXT)
    programs = split_programs_for(b, s.kv_heads, graph_splits, torch.device(s.device))
    # The engine rows' context (~1k, 3 splits used), and the longest a graph serves.
    for context in (ctx + 20, MAX_CONTEXT if s.device != "cpu" else 2 * ctx):
        eager, _ = decode_bandwidth(s, s.hidden // s.heads, batch=b, context=context)
        looped, _ = decode_bandwidth(s, s.hidden // s.heads, batch=b, context=context, splits=graph_splits)
        one_each, _ = decode_bandwidth(s, s.hidden // s.heads, batch=b, context=context, splits=graph_splits,
                                       programs=graph_splits)
        row(f"decode kernel b{b} ctx{context}, {graph_splits} splits (as graphed): {programs} / {graph_splits} "
            "programs per sequence and KV head", f"{looped * 1e6:.0f} / {one_each * 1e6:.0f} us "
            f"({looped / eager:.2f}x / {one_each / eager:.2f}x eager's {num_splits_for(context)} splits)", "(info)")
    rate = prefill_rate(s)
    row("prefill kernel, 16 x 512 causal, d64", f"{rate:.0f} TFLOP/s", "(info)")


# ------------------------------------------------------------------ 2b. tile sweep

def decode_bandwidth(s: Setup, head_dim: int, config=None, batch: int | None = None,
                     context: int | None = None, splits: int | None = None,
                     programs: int | None = None) -> tuple[float, float]:
    """(seconds, bytes) of one decode_attention call (default: batch bw_batch, context
    bw_context, the splits an eager step uses for that context, the launcher's programs
    per (sequence, KV head))."""
    import torch

    from engine.kernels.decode_attention import decode_attention, num_splits_for

    dtype = getattr(torch, s.dtype)
    b, ctx, bs = batch or s.bw_batch, context or s.bw_context, 16
    per_seq = -(-ctx // bs)
    cache = torch.randn(b * per_seq, 2, bs, s.kv_heads, head_dim, device=s.device).to(dtype)
    tables = torch.randperm(b * per_seq, device=s.device).to(torch.int32).view(b, per_seq)
    query = torch.randn(b, s.heads, head_dim, device=s.device).to(dtype)
    out = torch.empty_like(query)
    rows = torch.arange(b, dtype=torch.int32, device=s.device)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=s.device)
    splits = splits or num_splits_for(ctx)
    seconds = kernel_seconds(lambda: decode_attention(out, query, cache, rows, tables, lens, 0.1, splits,
                                                      config=config, split_programs=programs), s.device)
    return seconds, cache.numel() * cache.element_size() + 2 * query.numel() * query.element_size()


def prefill_rate(s: Setup, config=None, seqs: int = 16, q_len: int = 512) -> float:
    """TFLOP/s of prefill_attention over `seqs` fresh causal prompts of q_len tokens."""
    import torch

    from engine.kernels.prefill_attention import default_config, plan_tiles, prefill_attention

    dtype, head_dim, bs = getattr(torch, s.dtype), s.hidden // s.heads, 16
    config = config or default_config(torch.device(s.device))
    per_seq = q_len // bs
    cache = torch.randn(seqs * per_seq, 2, bs, s.kv_heads, head_dim, device=s.device).to(dtype)
    tables = torch.arange(seqs * per_seq, dtype=torch.int32, device=s.device).view(seqs, per_seq)
    query = torch.randn(seqs * q_len, s.heads, head_dim, device=s.device).to(dtype)
    out = torch.empty_like(query)
    lens = torch.full((seqs,), q_len, dtype=torch.int32, device=s.device)
    starts = torch.arange(seqs + 1, dtype=torch.int32, device=s.device) * q_len
    tile_seq, tile_start = (torch.from_numpy(a).to(s.device)
                            for a in plan_tiles([q_len] * seqs, range(seqs), config.block_m))
    seconds = kernel_seconds(lambda: prefill_attention(out, query, cache, tables, lens, starts, tile_seq,
                                                       tile_start, head_dim ** -0.5, config), s.device)
    flops = 4 * seqs * (q_len * (q_len + 1) // 2) * s.heads * head_dim  # QK^T and PV, causal half
    return flops / seconds / 1e12


def check_tuning(s: Setup) -> None:
    """Sweep tile sizes and launch options; the winners become this run's GPU configs
    (and, copied by hand, engine/kernels/*.GPU_CONFIG)."""
    import itertools

    from engine.kernels import decode_attention as decode_mod
    from engine.kernels import prefill_attention as prefill_mod
    from engine.kernels.common import LaunchConfig

    grid = ((32, 64, 128), (2, 4, 8), (2, 3, 4)) if s.device != "cpu" else ((32,), (4,), (1,))
    results = []
    for block_n, warps, stages in itertools.product(*grid):
        config = LaunchConfig(block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            times = [decode_bandwidth(s, d, config) for d in (64, 128)]
        except Exception as exc:  # e.g. out of shared memory: skip the config
            print(f"  decode {config}: {type(exc).__name__}", flush=True)
            continue
        pct = [100 * nbytes / sec / HBM_BYTES_PER_S for sec, nbytes in times]
        print(f"  decode n{block_n} w{warps} s{stages}: {pct[0]:.0f}% (d64) {pct[1]:.0f}% (d128)", flush=True)
        results.append((sum(sec for sec, _ in times), config, pct))
    _, best, pct = min(results, key=lambda r: r[0])
    decode_mod.GPU_CONFIG = best
    row("decode tiles", f"n{best.block_n} w{best.num_warps} s{best.num_stages}: {pct[0]:.0f}% / {pct[1]:.0f}%",
        "(chosen)")

    grid = (((64, 128), (32, 64), (4, 8), (2, 3)) if s.device != "cpu" else ((32,), (32,), (4,), (1,)))
    results = []
    for block_m, block_n, warps, stages in itertools.product(*grid):
        config = LaunchConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            rate = prefill_rate(s, config)
        except Exception as exc:
            print(f"  prefill {config}: {type(exc).__name__}", flush=True)
            continue
        print(f"  prefill m{block_m} n{block_n} w{warps} s{stages}: {rate:.0f} TFLOP/s", flush=True)
        results.append((rate, config))
    rate, best = max(results, key=lambda r: r[0])
    prefill_mod.GPU_CONFIG = best
    row("prefill tiles", f"m{best.block_m} n{best.block_n} w{best.num_warps} s{best.num_stages}: "
        f"{rate:.0f} TFLOP/s", "(chosen)")


# ------------------------------------------------------------------ model for rows 3-5

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
        options.update(attention_backend="triton", kv_cache_memory_gib=0.25)
    return LLM(model=str(model_dir), dtype=dtype, device=s.device, **options)


# ------------------------------------------------------------------ 3-5

def check_fp32_fidelity(s: Setup, work: Path) -> None:
    from engine import SamplingParams

    small = min(s.hidden, 512)  # head_dim 64 on the GPU, as in the 1B model
    model_dir = build_model(s, work / "fp32", "float32", layers=2, hidden=small,
                            heads=max(s.heads // s.kv_heads, small // 64))
    batch = prompts(s, 4, 64, seed=1)
    expected, _ = hf_greedy(model_dir, s, "float32", batch, 24)
    llm = make_llm(model_dir, s, "float32", max_num_seqs=8)
    outs = llm.generate(batch, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    same = sum(o.token_ids == e for o, e in zip(outs, expected))
    row("greedy == HF, float32", f"{same}/{len(batch)} requests identical", "all", same == len(batch))
    del llm
    free_memory(s)


def fill_decode_batch(core, s: Setup, b: int, tag: str = "step") -> list[str]:
    """Add b requests of step_context-token prompts and step until every one has its
    first token: a steady decode batch of b at context ~step_context. Returns their ids."""
    from engine import SamplingParams

    ids = [f"{tag}{b}-{i}" for i in range(b)]
    for rid, p in zip(ids, prompts(s, b, s.step_context, seed=4 + b)):
        core.add_request(rid, p, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    return ids


def mean_step_seconds(core, device: str, steps: int) -> float:
    """Mean time of `steps` consecutive steps, with no sync between them: with async
    scheduling each step's host work overlaps the previous step on the GPU, and a sync
    would drain that pipeline (a synchronous step waits for its own tokens anyway)."""
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    sync(device)
    return (time.perf_counter() - start) / steps


def replay_seconds(graphs, b: int, device: str) -> float:
    """Median time of replaying the CUDA graph that serves a decode batch of b."""
    graph = graphs.graphs[next(x for x in graphs.buckets if x >= b)][0]
    return median_seconds(graph.replay, device, 20)


def time_decode_steps(llm, s: Setup, b: int, label: str = "") -> float:
    """Decode step time at a steady batch of b: prefill everything, then time steps."""
    import torch

    core, cfg = llm.core, llm.core.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in core.model.parameters())
    ids = fill_decode_batch(core, s, b)
    step = mean_step_seconds(core, s.device, 20)
    ctx = s.step_context + 20
    kv_bytes = b * ctx * cfg.kv_bytes_per_token(torch.tensor([], dtype=getattr(torch, s.dtype)).element_size())
    floor = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S
    graphs, replay = core.runner.graphs, ""
    if graphs is not None:  # the GPU's share of the step; the rest is host work
        replay = f", graph replay {replay_seconds(graphs, b, s.device) * 1e3:.2f} ms"
    last = b == max(s.step_batches)
    row(f"decode step b{b} ctx~{ctx}{label}",
        f"{step * 1e3:.2f} ms = {step / floor:.2f}x floor ({floor * 1e3:.2f} ms){replay}",
        "<= 1.5x" if last else "(info)", step / floor <= 1.5 if last else None)
    core.abort(ids)
    while core.has_unfinished():  # an async engine's last step is still in flight
        core.step()
    return step


def check_engine(s: Setup, work: Path) -> None:
    from engine import SamplingParams

    model_dir = build_model(s, work / "bf16", s.dtype)
    fidelity_batch = prompts(s, 8, 64, seed=2)
    hf_tokens, _ = hf_greedy(model_dir, s, s.dtype, fidelity_batch, 32)
    workload = prompts(s, s.requests, s.prompt_len, seed=3)
    _, hf_seconds = hf_greedy(model_dir, s, s.dtype, workload[:s.hf_batch], s.new_tokens)
    hf_rate = s.hf_batch * s.new_tokens / hf_seconds

    llm = make_llm(model_dir, s, s.dtype, max_num_seqs=max(s.step_batches),
                   max_num_batched_tokens=8192 if s.device != "cpu" else 64)
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    graph_tokens = [o.token_ids for o in llm.generate(fidelity_batch, greedy, use_tqdm=False)]
    matches = sum(a == b for x, y in zip(graph_tokens, hf_tokens) for a, b in zip(x, y))
    row(f"greedy vs HF, {s.dtype}", f"{matches / (len(hf_tokens) * 32):.1%} of tokens match", "(info)")

    rate = offline_rate(llm, s, workload)
    row("offline throughput vs HF", f"{rate:,.0f} vs {hf_rate:,.0f} tok/s = {rate / hf_rate:.1f}x",
        ">= 20x", rate / hf_rate >= 20)

    # One 8192-token step: 16 512-token prompts, new ones each time (a prompt seen before
    # would be a prefix-cache hit and compute only its last block).
    prefill = functools.partial(prefill_next, llm, iter([prompts(s, 16, s.prompt_len, seed=100 + i)
                                                         for i in range(4)]))
    seconds = median_seconds(prefill, s.device, 3)
    layer_weights = sum(p.numel() for n, p in llm.core.model.named_parameters()
                        if n.startswith("layers.") and p.dim() == 2)
    flops = 2 * layer_weights * 16 * s.prompt_len
    row("prefill step, 16 x 512 new tokens", f"{seconds * 1e3:.1f} ms, {flops / seconds / 1e12:.0f} TFLOP/s "
        "(the layers' linears)", "(info)")
    sync_steps = {b: time_decode_steps(llm, s, b) for b in s.step_batches}
    del llm, prefill  # both hold the engine: its GPU memory goes back before the next one
    free_memory(s)
    check_async_scheduling(s, model_dir, fidelity_batch, graph_tokens, workload, hf_rate, sync_steps)

    if s.device.startswith("cuda"):
        eager = make_llm(model_dir, s, s.dtype, max_num_seqs=max(s.step_batches), enforce_eager=True)
        eager_tokens = [o.token_ids for o in eager.generate(fidelity_batch, greedy, use_tqdm=False)]
        same = eager_tokens == graph_tokens
        row("CUDA graphs == eager, greedy tokens", "identical" if same else "differ", "identical", same)
        del eager
        free_memory(s)


def prefill_next(llm, batches) -> None:
    """Prefill the next batch of prompts (one token each)."""
    from engine import SamplingParams

    llm.generate(next(batches), SamplingParams(max_tokens=1), use_tqdm=False)


def offline_rate(llm, s: Setup, workload: list[list[int]]) -> float:
    """Output tokens per second of LLM.generate over the whole workload (after a warm-up)."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=s.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(workload[:8], params, use_tqdm=False)
    sync(s.device)
    start = time.perf_counter()
    llm.generate(workload, params, use_tqdm=False)
    sync(s.device)
    return s.requests * s.new_tokens / (time.perf_counter() - start)


def check_async_scheduling(s: Setup, model_dir: Path, fidelity_batch: list[list[int]],
                           sync_tokens: list[list[int]], workload: list[list[int]], hf_rate: float,
                           sync_steps: dict[int, float]) -> None:
    """The engine rows again with async scheduling (the host schedules step N+1 while the
    GPU runs step N), and with every request of the offline workload in one batch."""
    from engine import SamplingParams

    gpu = s.device != "cpu"
    # The engine rows' setting, then every request in one batch with twice the prefill
    # chunk: fewer, larger steps for an offline workload.
    for max_seqs, max_tokens in ((max(s.step_batches), 8192 if gpu else 64), (s.requests, 16384 if gpu else 128)):
        llm = make_llm(model_dir, s, s.dtype, max_num_seqs=max_seqs, async_scheduling=True,
                       max_num_batched_tokens=max_tokens)
        label = f"async scheduling, max_num_seqs {max_seqs}, max_num_batched_tokens {max_tokens}"
        if max_seqs == max(s.step_batches):
            greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
            tokens = [o.token_ids for o in llm.generate(fidelity_batch, greedy, use_tqdm=False)]
            row("async scheduling == sync, greedy tokens", "identical" if tokens == sync_tokens else "differ",
                "identical", tokens == sync_tokens)
            for b in s.step_batches:
                step = time_decode_steps(llm, s, b, label=", async")
                row(f"decode step b{b}: sync / async", f"{sync_steps[b] / step:.2f}x", "(info)")
        rate = offline_rate(llm, s, workload)
        row(f"offline throughput vs HF, {label}", f"{rate:,.0f} vs {hf_rate:,.0f} tok/s = {rate / hf_rate:.1f}x",
            ">= 20x", rate / hf_rate >= 20)
        del llm
        free_memory(s)


def check_copy_kernels(s: Setup) -> None:
    """GPU time of the copy a cuda_ipc write issues (256 MiB in 2 MiB runs, scattered),
    in one process: how much of a transfer is the data plane."""
    import torch

    blocks, run = 512, 4  # 512 KiB blocks
    src = torch.randn(blocks, 512 << 8, device=s.device).view(torch.uint8)  # [blocks, 512 KiB]
    dst = torch.empty_like(src)
    runs = [(i * run, (blocks // run - 1 - i) * run, run) for i in range(blocks // run)]
    for name, a, b in (("uint8", src, dst), ("int64", src.view(torch.int64), dst.view(torch.int64))):
        seconds = kernel_seconds(lambda: torch._foreach_copy_([b[d:d + n] for _, d, n in runs],
                                                              [a[x:x + n] for x, _, n in runs]), s.device)
        row(f"fused copy of 128 runs as {name}", f"{src.numel() / seconds / 1e9:.0f} GB/s", "(info)")


def check_transfer(s: Setup) -> None:
    from benchmarks.kv_transfer import run_transport

    names = ["cuda_ipc"]
    try:
        import nixl  # noqa: F401  (carried as a wheel; the image lacks it)
        names.append("nixl")
    except ImportError:
        row("nixl transfer", "nixl not installed here", "(skipped)")
    for name in names:
        sizes, desc = ([256 << 20, 1 << 30], 2 << 20) if s.device != "cpu" else ([4 << 20], 1 << 20)
        # 512 KiB blocks: one block of the Llama-3.2-1B-shaped model in bf16 (16 layers).
        gib = run_transport(name, sizes, [desc], repeats=3, device=s.device,
                            block_bytes=(512 << 10) if s.device != "cpu" else (32 << 10))
        for i, size in enumerate(sizes):
            gbs = gib[(size, desc)] * 2**30 / 1e9
            row(f"{name} transfer {size >> 20} MiB, {desc >> 20} MiB desc", f"{gbs:.1f} GB/s",
                ">= 150 GB/s" if i == 0 else "(info)", gbs >= 150 if i == 0 else None)


# ------------------------------------------------------------------ diagnostics (--only profile,ucx)

def check_profile(s: Setup, work: Path) -> None:
    """Where a decode step's GPU time goes: torch.profiler over a steady batch of
    max(step_batches) at context ~step_context, run eagerly and then with the CUDA graphs,
    on one engine. Both are needed: a graph is captured with the decode splits of the
    longest context it serves (engine/cuda_graphs.py), an eager step with those of its own
    context, so their attention and split-reduction kernels differ."""
    from benchmarks import gpu_profile

    model_dir = work / "bf16"
    if not (model_dir / "config.json").exists():  # the engine section, if it ran, left it
        build_model(s, model_dir, s.dtype)
    b = max(s.step_batches)
    llm = make_llm(model_dir, s, s.dtype, max_num_seqs=b,
                   max_num_batched_tokens=8192 if s.device != "cpu" else 64)
    core = llm.core
    graphs = core.runner.graphs
    ids = fill_decode_batch(core, s, b, tag="profile")
    modes = [("eager", None)] + ([("graph", graphs)] if graphs is not None else [])
    walls: dict[str, float] = {}
    try:
        for mode, mode_graphs in modes:
            core.runner.graphs = mode_graphs  # None: every step runs the eager forward
            for _ in range(2):  # settle (and, eagerly, launch every kernel once)
                core.step()
            walls[mode] = mean_step_seconds(core, s.device, 8)
        replay = replay_seconds(graphs, b, s.device) if graphs is not None else None
        stats, errors = gpu_profile.profile_modes(
            core.step, [(mode, functools.partial(setattr, core.runner, "graphs", g)) for mode, g in modes],
            s.device, steps=5)
    finally:
        core.runner.graphs = graphs
    profiles = {mode: gpu_profile.StepProfile(stats.get(mode, {}), 5, walls[mode],
                                              replay if mode == "graph" else None) for mode, _ in modes}
    unit = "kernel" if s.device.startswith("cuda") else "aten op"  # CPU: ops' self time stand in
    print(f"  decode b{b} ctx~{s.step_context}+, 5 profiled steps per mode, ms per step:")
    for line in gpu_profile.format_profile(profiles, unit):
        print("  " + line, flush=True)
    summary = "; ".join(f"{m} {p.total_ms():.2f} / {p.wall_s * 1e3:.2f}"
                        + (f" (replay {p.replay_s * 1e3:.2f})" if p.replay_s is not None else "")
                        for m, p in profiles.items())
    row(f"profile b{b}: {unit}s / wall, ms per step", summary, "(info)")
    for mode, error in errors.items():
        row(f"profile b{b} {mode} steps", error, "(error)")
    last = next((m for m in reversed(profiles) if profiles[m].kernels), None)
    if last is not None:
        row(f"profile b{b} groups, {last}", ", ".join(f"{g} {ms:.2f}" for g, ms in profiles[last].groups().items()),
            "(info)")
    core.abort(ids)
    del llm
    free_memory(s)


def check_ucx(s: Setup) -> None:
    """nixl transfer GB/s under each gpu_profile.UCX_SETTINGS entry: benchmarks/kv_transfer.py
    in a fresh process per setting (UCX and NIXL read their environment at init), with a
    timeout per run and a time budget for the section."""
    from benchmarks import gpu_profile

    try:
        import nixl  # noqa: F401  (carried as a wheel; the image lacks it)
    except ImportError:
        row("nixl UCX settings", "nixl not installed here", "(skipped)")
        return
    gpu = s.device != "cpu"
    # As the transfer section: 2 MiB descriptors of 512 KiB blocks (the 1B model's block).
    sizes = [256, 1024] if gpu else [4]
    cmd = gpu_profile.transfer_command(s.device, sizes, 2048 if gpu else 1024, 512 if gpu else 32)
    budget_s, per_run_s = (170.0, 60.0) if gpu else (300.0, 45.0)
    start = time.perf_counter()
    for setting in gpu_profile.UCX_SETTINGS:
        left = budget_s - (time.perf_counter() - start)
        if left < 20:
            row(f"nixl UCX {setting.label}", "skipped: the section's time budget is spent", "(skipped)")
            continue
        run = gpu_profile.run_with_timeout(cmd, gpu_profile.child_env(os.environ, setting), min(per_run_s, left))
        gbs = gpu_profile.parse_gbs(run.output)
        if setting.diagnose:
            for line in gpu_profile.ucx_diagnosis(run.output):
                print(f"    ucx: {line}", flush=True)
        if run.returncode == 0 and all(size in gbs for size in sizes):
            measured = ", ".join(f"{size} MiB {gbs[size]:.1f}" for size in sizes) + f" GB/s ({run.seconds:.0f} s)"
            row(f"nixl UCX {setting.label}", measured, ">= 150 GB/s", gbs[sizes[0]] >= 150)
        else:  # keep what it measured before it failed or ran out of time
            why = "timed out" if run.returncode is None else f"exit {run.returncode}"
            got = "".join(f"{size} MiB {v:.1f} GB/s, " for size, v in gbs.items())
            row(f"nixl UCX {setting.label}", f"{why} after {run.seconds:.0f} s: {got}"
                f"{gpu_profile.failure_line(run.output)}", "(error)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    p.add_argument("--only", default="kernels,fp32,bandwidth,engine,transfer",
                   help="comma-separated sections; add tune to sweep the kernels' tiles; "
                        "profile and ucx are diagnostics (see the module docstring)")
    args = p.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    s = SMOKE if args.smoke else H200
    only = set(args.only.split(","))
    import torch

    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if s.device == 'cuda' else 'cpu'}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "kernels" in only:
            section("kernels vs reference", lambda: check_kernels(s))
        if "fp32" in only:
            section("float32 fidelity", lambda: check_fp32_fidelity(s, work))
        if "tune" in only:
            section("tile sweep", lambda: check_tuning(s))
        if "bandwidth" in only:
            section("decode bandwidth", lambda: check_bandwidth(s))
        if "engine" in only:
            section("engine", lambda: check_engine(s, work))
        if "profile" in only:
            section("decode step profile", lambda: check_profile(s, work))
        if "transfer" in only and s.device != "cpu":
            section("copy kernels", lambda: check_copy_kernels(s))
            section("KV transfer", lambda: check_transfer(s))
        if "ucx" in only:  # on CPU too: nixl moves DRAM there
            section("nixl under UCX settings", lambda: check_ucx(s))
    widths = [max(len(r[i]) for r in ROWS) for i in range(4)] if ROWS else [0] * 4
    print("\n| check | measured | target | |\n|---|---|---|---|")
    for r in ROWS:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    failed = [r for r in ROWS if r[3] == "FAIL"]
    print(f"\n{len(ROWS) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
