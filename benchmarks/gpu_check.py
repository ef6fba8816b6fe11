"""The one-shot GPU check: correctness first, then timings, as one short table.

    python benchmarks/gpu_check.py                 # on an H200: about 8 minutes, models built included
    python benchmarks/gpu_check.py --smoke         # on CPU, tiny shapes, Triton interpreter for
                                                   # the kernels: checks this script, not the GPU
    python benchmarks/gpu_check.py --only serve    # one section again

Rows 1-5 need only torch, triton, transformers and numpy (what the H200 image has).
Row 6 also needs pyzmq and msgpack (and nixl for its nixl row); row 7 (the served
benchmark: the router and its worker processes) also msgspec, fastapi, uvicorn, httpx2,
prometheus-client, xxhash, pyyaml, tqdm and their dependencies (pip resolves those in
the second download). All are carried as cp312 wheels (see the device README), e.g.:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux2014_x86_64 -d .whl pyzmq==27.3.0 msgpack==1.2.4
    python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 -d .whl msgspec==0.22.0 fastapi==0.165.0 uvicorn==0.54.0 \
        httpx2==2.16.2 prometheus-client==0.26.0 xxhash==4.1.0 pyyaml tqdm
    # on the device, carrying .whl:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
        && PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py

Rows:
 1. each Triton kernel against the torch reference in bf16 (relative error <= 1e-2, no NaN)
 1b. the grammar-mask kernel (structured outputs) bit-exact against torch, and its time on
    half of a batch of 256 rows over the 128k vocabulary (<= 50 us)
 1c. the LoRA SGMV kernels (lora.py) against LoRALinear's torch path in bf16 (<= 2e-2), and
    what 4 adapters add to a 2048 -> 3072 projection's time at batch 32, rank 8 and 64,
    beside the torch path's (reported)
 2. decode-attention bandwidth: bytes it must read / its time, vs 4.23 TB/s (>= 80% at
    batch 64, context 2k)
 2b. fp8 KV cache (fp8_kv.py): the decode kernel over an fp8 cache against the bf16-widened
    cache (<= 1e-2), its bandwidth (>= 85% of HBM for the bytes read, bf16's time beside
    it), fp8 GEMM TFLOP/s (torch._scaled_mm) against bf16, and offline throughput with an
    fp8 cache against bf16's on the engine rows' model
 3. engine decode step at batch 64 and 256, context ~1k, vs the roofline floor: per kernel
    class (benchmarks/offline/roofline/analytic.py) the larger of bytes / 4.23 TB/s and FLOPs /
    760 TFLOP/s, summed over classes (<= 1.3x at batch 256)
 4. offline throughput of LLM.generate vs HF generate, Llama-3.2-1B-shaped random bf16
    model, 512-token prompts, 128 new tokens (>= 25x)
 5. greedy tokens equal to HF in float32 (exact); in bf16 the fraction that match; CUDA
    graphs vs eager identical
 5b. rows 3 and 4 again with async scheduling (greedy tokens identical to the synchronous
    engine's), and the offline workload again with all its requests in one batch and
    16k-token steps
 5d. KV offload tiers (kv_tiers.py): a multi-turn chat ~4x the KV pool in float32, with a
    pinned host tier, and with a disk tier below a small host tier: greedy tokens identical
    to a pool that holds it all, blocks loaded back, none failed; the load-back GB/s and
    the chat's time against recomputing (information; about a minute)
 5c. n-gram speculative decoding (k=4): greedy tokens equal to the plain engine's in float32
    on the device (random and repetitive prompts, with drafts verified); then, on the bf16
    model of rows 3-5b, output tokens/s with and without drafts on repetitive prompts (a
    random span repeated) at batch 1 and 16, and the acceptance rate (information: the
    model is random; about a minute)
 6. KV transfer between two processes on the GPU, 256 MiB in 2 MiB descriptors:
    cuda_ipc, and nixl if its wheel came along (>= 150 GB/s)
 6b. KV streaming modes (streaming.py): a remote prefill's TTFT over its own compute with
    transport_options.stream off, chunk and layer, 1024- and 3072-token prompts, 1P1D on
    the GPU over cuda_ipc and nixl; the modes' first tokens identical (about a minute)
 7. serve: configs/gpu-1p1d.yaml (a prefill and a decode worker sharing the GPU, KV over
    cuda_ipc) against its colocated twin configs/gpu-colocated.yaml, behind the router,
    on a Llama-3.2-1B-shaped model with weights generated on the device (load_format
    dummy) and a synthetic one-word-per-id tokenizer: greedy text identical; Poisson
    arrivals at 2, 12 and 36 req/s (30, 90, 180 requests; prompts of 1536-2560 tokens, 128
    output tokens), TTFT/TPOT/ITL p50/p99 and the KV transfer time per request from the
    router's metrics; P5 (at 2/s, TTFT p50 and p99 <= 1.15x colocated) and P6 (at 36/s,
    p99 TPOT <= 0.5x colocated, both throughputs shown); the nixl config's greedy text
    and 2/s run if nixl imports. Sized to about 3 minutes (three service starts of ~30 s,
    ~30 s of load per setup): see benchmarks/gpu/shapes.py. The long P5/P6 measurement
    (200+ requests per setup, 3 seeds) is benchmarks/serving/serve.py's (docs/benchmarks/2026-12-02-serving-p5-p6.md).
A failing section prints FAIL with its error and the script goes on to the next.

Diagnostics, not in the default run (helpers in benchmarks/gpu/profiling.py):

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
 ucx: benchmarks/kv/transfer.py for nixl alone (2 MiB descriptors, 512 KiB blocks, as row 6)
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

Layout: this file is the command line; each section is a module of benchmarks/gpu/
(kernels.py row 1, bandwidth.py row 2, tuning.py the tile sweep, fidelity.py and
engine_rows.py rows 3-5b, kv_tiers.py row 5d with decode_step.py and model.py, speculative.py row 5c,
mla_moe.py the MLA decode and fused MoE kernels' rows, lora.py row 1c, fp8_kv.py row 2b,
transfer.py row 6, streaming.py row 6b, serving.py row 7, step_profile.py and ucx.py the diagnostics,
report.py the rows and the table). --smoke runs every default section on CPU in about a minute (tests/benchmarks/
test_gpu_check_smoke.py, in make test): the kernels under the Triton interpreter, the
engines on the torch attention backend, the served model tiny over shm; timing targets
are shown there but not judged.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

# Runnable as `python3 benchmarks/gpu_check.py` with nothing on PYTHONPATH: the repo root
# holds the `engine` and `benchmarks` packages. It goes first, and this file's folder,
# which a script run as a file gets at the head of sys.path, goes: a benchmarks/ module
# or package named like a top-level one would shadow it.
_REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

# The sections import torch and the kernels inside their functions: --smoke sets
# TRITON_INTERPRET before any kernel module is imported.
from benchmarks.gpu.bandwidth import check_bandwidth  # noqa: E402
from benchmarks.gpu.bitmask import check_bitmask  # noqa: E402
from benchmarks.gpu.engine_rows import check_engine  # noqa: E402
from benchmarks.gpu.fidelity import check_fp32_fidelity  # noqa: E402
from benchmarks.gpu.fp8_kv import check_fp8_kv  # noqa: E402
from benchmarks.gpu.kernels import check_kernels  # noqa: E402
from benchmarks.gpu.kv_tiers import check_kv_tiers  # noqa: E402
from benchmarks.gpu.lora import check_lora_rows  # noqa: E402
from benchmarks.gpu.mla_moe import check_moe_mla_rows  # noqa: E402
from benchmarks.gpu.report import judge_timings, print_table, section  # noqa: E402
from benchmarks.gpu.serving import check_serving  # noqa: E402
from benchmarks.gpu.shapes import H200, SMOKE  # noqa: E402
from benchmarks.gpu.speculative import check_speculative  # noqa: E402
from benchmarks.gpu.step_profile import check_profile  # noqa: E402
from benchmarks.gpu.streaming import check_streaming  # noqa: E402
from benchmarks.gpu.transfer import check_copy_kernels, check_transfer  # noqa: E402
from benchmarks.gpu.tuning import check_tuning  # noqa: E402
from benchmarks.gpu.ucx import check_ucx  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    p.add_argument("--only", default="kernels,fp32,bandwidth,fp8,engine,tiers,speculative,transfer,stream,serve",
                   help="comma-separated sections; add tune to sweep the kernels' tiles; "
                        "profile and ucx are diagnostics (see the module docstring)")
    args = p.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
        judge_timings(False)
    s = SMOKE if args.smoke else H200
    only = set(args.only.split(","))
    import torch

    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if s.device == 'cuda' else 'cpu'}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "kernels" in only:
            section("kernels vs reference", lambda: check_kernels(s))
            section("grammar mask kernel", lambda: check_bitmask(s))
            section("MoE and MLA kernels", lambda: check_moe_mla_rows(s))
            section("LoRA SGMV kernels", lambda: check_lora_rows(s))
        if "fp32" in only:
            section("float32 fidelity", lambda: check_fp32_fidelity(s, work))
        if "tune" in only:
            section("tile sweep", lambda: check_tuning(s))
        if "bandwidth" in only:
            section("decode bandwidth", lambda: check_bandwidth(s))
        if "fp8" in only:
            section("fp8 KV cache", lambda: check_fp8_kv(s, work))
        if "engine" in only:
            section("engine", lambda: check_engine(s, work))
        if "tiers" in only:
            section("KV offload tiers", lambda: check_kv_tiers(s, work))
        if "speculative" in only:
            section("speculative decoding", lambda: check_speculative(s, work))
        if "profile" in only:
            section("decode step profile", lambda: check_profile(s, work))
        if "transfer" in only and s.device != "cpu":
            section("copy kernels", lambda: check_copy_kernels(s))
            section("KV transfer", lambda: check_transfer(s))
        if "stream" in only:
            section("KV streaming modes", lambda: check_streaming(s, work))
        if "serve" in only:
            section("serve", lambda: check_serving(s, work))
        if "ucx" in only:  # on CPU too: nixl moves DRAM there
            section("nixl under UCX settings", lambda: check_ucx(s))
    sys.exit(1 if print_table() else 0)


if __name__ == "__main__":
    main()
