"""The GPU check's two sets of shapes: the H200 run and the CPU smoke run."""

from __future__ import annotations

from dataclasses import dataclass

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
    bw_prefill: tuple[int, int] = (16, 512)  # the prefill kernel's rate: prompts x tokens
    # The engines of rows 3-5b on CPU (the smoke run). Not the Triton interpreter, where one
    # kernel call costs more than a whole step of the torch backend: the kernels section
    # checks each kernel against its reference there, and tests/fidelity/
    # test_triton_fidelity.py the engine on them.
    cpu_attention_backend: str = "torch"
    # The serve section (serving.py): Poisson rates (req/s), requests per rate, prompt
    # tokens U[min, max], output tokens; the correctness prompts: count, length, tokens.
    serve_rates: tuple[float, ...] = ()
    serve_requests: tuple[int, ...] = ()
    serve_prompt: tuple[int, int] = (1536, 2560)
    serve_output: int = 128
    serve_check_prompts: int = 8
    serve_check_len: int = 300
    serve_check_tokens: int = 32
    # The stream section (streaming.py): prompt lengths and timed repeats per mode.
    stream_tokens: tuple[int, ...] = (1024, 3072)
    stream_repeats: int = 3


# The serve section's load on the H200 is sized to about 3 minutes with its three service
# starts (benchmarks/gpu/serving.py): ~15 s of arrivals at 2/s, ~8 s at 12/s and ~5 s at
# 36/s (about 72k prompt tokens/s: prefill-heavy) per setup.
H200 = Setup("cuda", "bfloat16", 2048, 8192, 16, 32, 8, 128256, 64, 2048, (64, 256), 1024,
             1024, 512, 128, 128, serve_rates=(2.0, 12.0, 36.0), serve_requests=(30, 90, 180))
SMOKE = Setup("cpu", "float32", 64, 128, 2, 4, 2, 512, 2, 64, (2,), 40, 4, 24, 4, 4, bw_prefill=(2, 32),
              serve_rates=(6.0,), serve_requests=(5,), serve_prompt=(70, 120), serve_output=4,
              serve_check_prompts=3, serve_check_len=80, serve_check_tokens=6, stream_tokens=(40,), stream_repeats=1)
