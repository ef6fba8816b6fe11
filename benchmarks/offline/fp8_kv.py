"""An fp8 KV cache on CPU against the 16-bit (and float32) cache, in one run, on the demo
model (SmolLM2-135M-Instruct):

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.offline fp8_kv                   # ~6 min on 2 cores
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.offline fp8_kv --rounds 1 --steps 3 --skip-fidelity  # smoke

1. KV blocks per GiB: what each engine allocates from kv_cache_memory_gib.
2. Bytes per remote prefill: one prompt of --pd-prompt tokens prefilled by one engine
   and pushed into another's cache over shm and over tcp (real transports, in one
   process), as the prefill side's transfer metrics (bytes_written) count them; the
   demo in bfloat16, default cache against fp8; the decoded tokens are checked against
   the colocated engine of the same configuration.
3. Decode ms per step at B = 32, 8, 1 over --decode-prompt-token contexts, and prefill
   tokens per second, for bfloat16 and float32 with and without an fp8 cache, and
   float32 with fp8 weights (w8: weight-only on CPU, dequantized in each call), measured
   in turn (order flipped every round; benchmarks/offline/tp_cpu.py's timers), medians.
4. Teacher-forced agreement with float32 transformers (tests/fidelity/agreement.py),
   with fp8 weights too, and what per-layer scales calibrated from the texts' K/V maxima
   change.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.offline.one_push import push_one  # noqa: E402
from benchmarks.offline.tp_cpu import (  # noqa: E402
    Config,
    close_configs,
    parse_rounds,
    round_blocks,
    round_parser,
    run_rounds,
)
from cluster.demo_model import DEMO_MODELS, default_models_dir  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

DEMO = default_models_dir() / DEMO_MODELS["smollm2"].dir_name
ENGINES = [("bf16", "bfloat16", "auto"), ("bf16+fp8", "bfloat16", "fp8"),
           ("fp32", "float32", "auto"), ("fp32+fp8", "float32", "fp8")]
# fp8 weights (quantization: fp8, online per-channel), weight-only on CPU: w8.
WEIGHT_ENGINES = [("fp32 w8", "float32", "auto"), ("bf16 w8", "bfloat16", "auto"), ("fp32 w8+fp8", "float32", "fp8")]


class KVConfig(Config):
    def __init__(self, label: str, dtype: str, kv_cache_dtype: str, batched_tokens: int,
                 quantization: str | None = None) -> None:
        super().__init__(label, str(DEMO), 1, 2)
        self.dtype, self.kv_cache_dtype, self.quantization = dtype, kv_cache_dtype, quantization
        self.batched_tokens = batched_tokens  # every decode prompt in one step: all start decoding together

    def start(self, num_kv_blocks: int) -> None:
        self.llm = LLM(self.model, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype, num_threads=self.threads,
                       quantization=self.quantization,
                       enable_prefix_caching=False, num_kv_blocks=num_kv_blocks,
                       max_num_batched_tokens=self.batched_tokens)


def blocks_per_gib() -> dict[str, int]:
    out = {}
    for label, dtype, kv in ENGINES:
        llm = LLM(str(DEMO), dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_gib=0.25)
        out[label] = llm.core.kv.pool.num_blocks * 4
        llm.core.close()
    return out


def remote_prefill_bytes(transport: str, kv_cache_dtype: str, prompt: list[int]) -> int:
    """Bytes the prefill engine wrote for one request. (Its tokens are not checked
    here: in bfloat16 a prompt's last token computed as a decode row on the decode
    worker rounds differently from the colocated engine's prompt pass; the tests check
    disaggregated tokens in float32, tests/disagg/test_fp8_remote_prefill.py.)"""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return push_one(DEMO, transport, prompt, params, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                    num_kv_blocks=128)[0]


def layer_amax(llm: LLM, ref: list) -> list[tuple[float, float]]:
    """Per layer, the largest |K| and |V| the fixed texts produce (before scaling), as
    the model hands them to the cache's rounding."""
    import engine.model.llama as llama
    from tests.fidelity.agreement import measure

    seen: list[float] = []
    rounding = llama.round_to_cache

    def spy(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        seen.append(float(x.abs().max()))
        return rounding(x, scale, dtype)

    llama.round_to_cache = spy  # type: ignore[assignment]
    try:
        measure(llm, ref)
    finally:
        llama.round_to_cache = rounding  # type: ignore[assignment]
    layers = llm.core.model_config.num_layers
    amax = [[0.0, 0.0] for _ in range(layers)]
    for i, value in enumerate(seen):  # K then V, layer after layer, step after step
        side, layer = i % 2, (i // 2) % layers
        amax[layer][side] = max(amax[layer][side], value)
    return [(k, v) for k, v in amax]


def fidelity() -> list[str]:
    """Agreement rows; then fp8 (e4m3) with per-layer scales calibrated from the texts'
    maxima (amax * headroom / 448) instead of 1.0: what calibrated static scales buy."""
    from tests.fidelity.agreement import measure, reference

    rows, ref = [], None
    for label, dtype, kv in ENGINES + [("fp32+fp8_e5m2", "float32", "fp8_e5m2")]:
        llm = LLM(str(DEMO), dtype=dtype, kv_cache_dtype=kv, num_kv_blocks=64)
        ref = ref or reference(DEMO, llm)
        rows.append(measure(llm, ref).row(label))
        llm.core.close()
    for label, dtype, kv in WEIGHT_ENGINES:
        llm = LLM(str(DEMO), dtype=dtype, kv_cache_dtype=kv, quantization="fp8", num_kv_blocks=64)
        rows.append(measure(llm, ref).row(label))
        llm.core.close()
    rows.append(w8a8_row(ref))
    llm = LLM(str(DEMO), kv_cache_dtype="fp8", num_kv_blocks=64, enable_prefix_caching=False)
    amax = layer_amax(llm, ref)
    print(f"largest |K| over the layers {max(k for k, _ in amax):.1f}, |V| {max(v for _, v in amax):.1f} "
          "(e4m3 saturates at 448)", flush=True)
    for headroom in (1.0, 4.0, 16.0):
        for layer, (k, v) in zip(llm.core.model.layers, amax):
            layer.self_attn.k_scale, layer.self_attn.v_scale = k * headroom / 448, v * headroom / 448
        rows.append(measure(llm, ref).row(f"fp32+fp8, scales amax*{headroom:g}/448"))
    llm.core.close()
    rows.append(per_token_scales(ref))
    return rows


def w8a8_row(ref: list) -> str:
    """fp8 weights as CUDA runs them (engine/model/fp8_linear.py: torch._scaled_mm with
    per-token activation scales), through torch's CPU _scaled_mm."""
    from engine.model import fp8_linear
    from tests.fidelity.agreement import measure

    saved = fp8_linear._scaled_mm_ok
    fp8_linear._scaled_mm_ok = lambda x, out_features: True  # type: ignore[assignment]
    try:
        llm = LLM(str(DEMO), dtype="bfloat16", quantization="fp8", num_kv_blocks=64)
        row = measure(llm, ref).row("bf16 w8a8 (the CUDA path, _scaled_mm on CPU)")
        llm.core.close()
    finally:
        fp8_linear._scaled_mm_ok = saved  # type: ignore[assignment]
    return row


def per_token_scales(ref: list) -> str:
    """The design not built, simulated: e4m3 with a dynamic scale per token and head
    (amax / 448 of each K and V vector), on a float32 cache holding the dequantized
    values, so the model computes with what such a cache would give back."""
    import engine.model.llama as llama
    from tests.fidelity.agreement import measure

    def fake_quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
        return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * s

    saved = llama.is_fp8, llama.round_to_cache
    llama.is_fp8, llama.round_to_cache = (lambda dtype: True), fake_quantize  # type: ignore[assignment]
    try:
        llm = LLM(str(DEMO), num_kv_blocks=64)
        row = measure(llm, ref).row("fp32+fp8, per-(token, head) scales (simulated)")
        llm.core.close()
    finally:
        llama.is_fp8, llama.round_to_cache = saved  # type: ignore[assignment]
    return row


# The README's prompts: (chat messages or a completion prompt, max_tokens).
README_PROMPTS = [([{"role": "user", "content": "What is the capital of France?"}], 20),
                  ("Hello", 8), ([{"role": "user", "content": "Name three colors."}], 24)]


def readme_answers() -> list[str]:
    """Each engine's greedy answer to the README's prompts, as table rows."""
    rows = []
    for label, dtype, kv in ENGINES + [("fp32+fp8_e5m2", "float32", "fp8_e5m2")]:
        llm = LLM(str(DEMO), dtype=dtype, kv_cache_dtype=kv, num_kv_blocks=64)
        answers = []
        for prompt, max_tokens in README_PROMPTS:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            out = (llm.generate(prompt, params, use_tqdm=False) if isinstance(prompt, str)
                   else llm.chat(prompt, params, use_tqdm=False))
            answers.append(repr(out[0].text).replace("|", "\\|"))
        rows.append(f"| {label} | " + " | ".join(answers) + " |")
        llm.core.close()
    return rows


def main() -> None:
    parser = round_parser(__doc__, decode_prompt=512)
    parser.add_argument("--pd-prompt", type=int, default=500)
    parser.add_argument("--skip-fidelity", action="store_true")
    args = parse_rounds(parser)
    if not (DEMO / "config.json").is_file():
        sys.exit(f"the demo model is not prepared in {DEMO}: make model")
    print(f"load average before: {os.getloadavg()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="fp8_kv_"))
    print("| engine | KV blocks per GiB (16 tokens) |\n|---|---|")
    for label, n in blocks_per_gib().items():
        print(f"| {label} | {n} |", flush=True)
    prompt = [(i * 7919) % 40000 + 100 for i in range(args.pd_prompt)]
    print(f"\n| transport | bf16 cache bytes/request | fp8 cache bytes/request | ratio |  ({args.pd_prompt}-token prompt)")
    print("|---|---|---|---|")
    for transport in ("shm", "tcp"):
        wide, narrow = (remote_prefill_bytes(transport, kv, prompt) for kv in ("auto", "fp8"))
        print(f"| {transport} | {wide} | {narrow} | {narrow / wide:.3f} |", flush=True)

    tokens = max(args.batches) * args.decode_prompt
    configs = [KVConfig(label, dtype, kv, tokens) for label, dtype, kv in ENGINES]
    configs.append(KVConfig("fp32 w8", "float32", "auto", tokens, "fp8"))  # weight-only fp8 on CPU
    try:
        for cfg in configs:
            cfg.start(round_blocks(args))
    except BaseException:
        close_configs(configs)
        raise
    results = run_rounds(configs, args)  # and closes them
    keys = [f"decode B={b} step" for b in sorted(args.batches, reverse=True)] + ["prefill tok/s"]
    print(f"\nmedians of {args.rounds} rounds ({args.steps} steps each), contexts of {args.decode_prompt}:")
    print("| engine | " + " | ".join(k.replace(" step", " ms/step") for k in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for cfg in configs:
        med = {k: statistics.median(results[cfg.label][k]) for k in keys}
        base = "bf16" if cfg.label.startswith("bf16") else "fp32"
        ratio = {k: med[k] / statistics.median(results[base][k]) for k in keys}
        print(f"| {cfg.label} | " + " | ".join(f"{med[k]:.1f} ({ratio[k]:.2f}x)" for k in keys) + " |", flush=True)
    print("\n| engine | " + " | ".join(repr(p if isinstance(p, str) else p[0]["content"]) for p, _ in README_PROMPTS)
          + " |\n|---" * 1 + "|---" * len(README_PROMPTS) + "|")
    for line in readme_answers():
        print(line, flush=True)
    if not args.skip_fidelity:
        print("\n| engine | positions | top-1 all | confident | top-1 confident | mean abs d logprob |")
        print("|---|---|---|---|---|---|")
        for row in fidelity():
            print(row, flush=True)
    torch.set_num_threads(2)
    tmp.rmdir()


if __name__ == "__main__":
    main()
