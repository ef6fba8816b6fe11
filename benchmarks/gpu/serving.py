"""The serve section of the GPU check: the disaggregated service (configs/gpu-1p1d.yaml's
settings) against its colocated twin (configs/gpu-colocated.yaml) on a Llama-3.2-1B-
shaped model whose weights every worker generates on the device (load_format dummy),
behind the router, started in this process as benchmarks/serving/serve.py does.

Correctness first: greedy text of the two setups on the same prompts, sent one at a time
and shorter than any step's token budget (so both compute each prompt as one chunk),
must be equal. Then Poisson arrivals at each of the Setup's rates, the same seeded
requests for both setups: TTFT, TPOT and ITL p50/p99, and the KV transfer time per
request from the router's metrics; P5 (low load, the first rate: TTFT <= 1.15x
colocated) and P6 (the last rate, prefill-heavy: p99 TPOT <= 0.5x colocated, both
throughputs shown) as rows. The nixl variant (configs/gpu-1p1d-nixl.yaml) runs the
correctness check and the lowest rate, where nixl imports.

The tokenizer is synthetic (one word per id, "t0" ... "t128255"): the model keeps
Llama-3.2-1B's 128256-entry vocabulary, every id it generates decodes to its own word,
so equal text means equal tokens, and nothing needs carrying to the device (the demo
model's tokenizer covers 49152 ids and lives in the git-ignored models/).
"""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path
from typing import Any

from benchmarks.gpu.report import row
from benchmarks.gpu.shapes import Setup

REPO = Path(__file__).resolve().parents[2]


def write_model_dir(s: Setup, out: Path) -> Path:
    """config.json of the Setup's Llama shape (no weights: load_format dummy) and the
    synthetic tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s.hidden,
              "intermediate_size": s.intermediate, "num_hidden_layers": s.layers,
              "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "vocab_size": s.vocab,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(s.vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2",
                            clean_up_tokenization_spaces=False).save_pretrained(out)
    return out


def cluster_config(s: Setup, name: str, model_dir: Path):
    """configs/<name>.yaml with the generated model on a free port; on CPU (the smoke run)
    the same shape of service with CPU settings: shm, float32, one thread per worker."""
    import yaml

    from cluster.config import ClusterConfig

    data: dict[str, Any] = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    data.update(model=str(model_dir), load_format="dummy")
    data["router"]["port"] = port
    if s.device == "cpu":
        data.update(device="cpu", dtype="float32", transport="shm")
        for role in ("prefill", "decode"):
            engine = data[role].get("engine", {})
            engine.pop("gpu_memory_utilization", None)
            engine.update(num_threads=1, kv_cache_memory_gib=0.25, max_num_seqs=16,
                          max_num_batched_tokens=min(engine.get("max_num_batched_tokens", 256), 256))
    return ClusterConfig.from_dict(data)


def greedy_texts(url: str, model: str, prompts: list[list[int]], tokens: int) -> list[str]:
    """One request at a time, so both setups compute each prompt in a batch of one."""
    import httpx2 as httpx

    out = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
        response = httpx.post(f"{url}/completions", json=body, timeout=300.0)
        response.raise_for_status()
        out.append(response.json()["choices"][0]["text"])
    return out


def run_setup(s: Setup, name: str, model_dir: Path, rates: tuple[float, ...]) -> tuple[list[str], list[dict]]:
    """Start configs/<name>.yaml's service, ask it the correctness prompts, then load it at
    each rate; (the greedy texts, one run summary per rate)."""
    from benchmarks.serving.load import Workload
    from benchmarks.serving.report import number
    from benchmarks.serving.serve import run_load
    from benchmarks.serving.server import serving

    check = [[(7 * i + 13 * j) % (s.vocab - 200) + 100 for j in range(s.serve_check_len)]
             for i in range(s.serve_check_prompts)]
    workload = Workload(output_len=(s.serve_output, s.serve_output), prompt_tokens=s.serve_prompt,
                        token_ids=(100, s.vocab))
    with serving(cluster_config(s, name, model_dir), None) as (url, model):
        texts = greedy_texts(url, model, check, s.serve_check_tokens)
        runs = [run_load(url, model, workload, 0, i, rate=rate, num_requests=n)
                for i, (rate, n) in enumerate(zip(rates, s.serve_requests))]
    for rate, run in zip(rates, runs):
        kv = run["kv_transfer"]
        transfer = ("" if not kv or not kv["count"] else
                    f", KV transfer mean {number(kv['mean'], 1e3, 1)} ms p50 {number(kv['p50'], 1e3, 1)} p99 "
                    f"{number(kv['p99'], 1e3, 1)} (buckets) over {kv['count']:.0f}")
        row(f"{name} at {rate}/s: {run['completed']}/{run['requests']} ok, {run['request_throughput']:.2f} req/s",
            f"TTFT {_ms(run['ttft'])}, TPOT {_ms(run['tpot'])}, ITL {_ms(run['itl'])}{transfer}", "(info)",
            None if run["completed"] == run["requests"] else False)
    return texts, runs


def _ms(p: dict[str, float | None]) -> str:
    """p50/p99 in ms; "-" for a value with no data (NaN in memory, null in a JSON)."""
    from benchmarks.serving.report import number

    return f"{number(p['p50'], 1e3, 1)}/{number(p['p99'], 1e3, 1)} ms"


def _ratio_row(name: str, what: str, a: float | None, b: float | None, bound: float, extra: str = "") -> None:
    from benchmarks.serving.report import known, number

    ratio = a / b if known(a) and known(b) and b > 0 else math.nan
    row(f"{name}: {what}, disaggregated / colocated",
        f"{number(a, 1e3, 1)} / {number(b, 1e3, 1)} ms = {ratio:.2f}x{extra}", f"<= {bound}x", ratio <= bound)


def check_serving(s: Setup, work: Path) -> None:
    model_dir = write_model_dir(s, work / "served_model")
    rates = s.serve_rates
    texts, disagg = run_setup(s, "gpu-1p1d", model_dir, rates)
    coloc_texts, coloc = run_setup(s, "gpu-colocated", model_dir, rates)
    same = sum(a == b for a, b in zip(texts, coloc_texts))
    row(f"served greedy text, disaggregated == colocated ({len(texts)} prompts of {s.serve_check_len} tokens)",
        f"{same}/{len(texts)} identical", "all", same == len(texts))
    low, high = (disagg[0], coloc[0]), (disagg[-1], coloc[-1])
    for stat in ("p50", "p99"):
        _ratio_row(f"P5 at {rates[0]}/s", f"TTFT {stat}", low[0]["ttft"][stat], low[1]["ttft"][stat], 1.15)
    _ratio_row(f"P6 at {rates[-1]}/s", "p99 TPOT", high[0]["tpot"]["p99"], high[1]["tpot"]["p99"], 0.5,
               f" at {high[0]['request_throughput']:.2f} / {high[1]['request_throughput']:.2f} req/s")
    if s.device != "cpu":
        from importlib.util import find_spec

        if find_spec("nixl") is None:
            row("gpu-1p1d-nixl", "skipped: nixl is not installed", "(info)")
            return
        nixl_texts, _ = run_setup(s, "gpu-1p1d-nixl", model_dir, rates[:1])
        same = sum(a == b for a, b in zip(nixl_texts, coloc_texts))
        row("served greedy text over nixl == colocated", f"{same}/{len(texts)} identical", "all", same == len(texts))
