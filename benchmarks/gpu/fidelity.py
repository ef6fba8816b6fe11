"""Row 5's exact check: greedy tokens equal to HF's in float32."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu.model import build_model, free_memory, hf_greedy, make_llm, prompts
from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import Setup


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
