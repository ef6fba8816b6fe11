"""Compile time of the 20-field schema through GrammarCompiler: the one-time tokenizer
info (tokenizer load + xgrammar's TokenizerInfo, per engine), the grammar build (schema
to EBNF, no tokenizer), a cold compile (a fresh compiler each repeat, its tokenizer info
already built), and a cache hit."""

from __future__ import annotations

import time
from typing import Any

from benchmarks.offline.structured_bench.schema import schema_text
from benchmarks.offline.structured_bench.stats import Stat, per_call
from engine.model.config import ModelConfig
from engine.structured.compiler import GrammarCompiler
from engine.structured.grammar import build_grammar
from engine.structured.params import StructuredOutputsParams


def compile_times(model: str, repeats: int, hits: int) -> dict[str, Any]:
    config = ModelConfig.from_model_dir(model)
    params = StructuredOutputsParams(json=schema_text())
    info, cold, hit = [], [], []
    for _ in range(repeats):
        compiler = GrammarCompiler(model, config.vocab_size, config.eos_token_ids)
        try:
            start = time.perf_counter()
            compiler._xgr_compiler()  # what the first structured request of an engine pays once
            info.append(time.perf_counter() - start)
            start = time.perf_counter()
            future = compiler.compile(params)
            future.result()
            cold.append(time.perf_counter() - start)
            hit.append(per_call(lambda: compiler.compile(params).result(), 1, hits).median)
        finally:
            compiler.close()
    build = per_call(lambda: build_grammar(params), repeats, 3)
    return {"tokenizer_info": Stat(info), "grammar_build": build, "cold_compile": Stat(cold),
            "cache_hit": Stat(hit), "repeats": repeats}


def print_compile(result: dict[str, Any]) -> None:
    print(f"\n### Compile time, the 20-field schema (median of {result['repeats']} fresh compilers, "
          "min-max in brackets)\n")
    print("| step | ms |\n|---|---:|")
    print(f"| tokenizer info (once per engine: tokenizer load + xgr.TokenizerInfo) | "
          f"{result['tokenizer_info'].show(1e3, 1)} |")
    print(f"| grammar build alone (schema -> EBNF, part of a cold compile) | {result['grammar_build'].show(1e3, 2)} |")
    print(f"| cold compile (build + compile against the vocabulary, via the pool) | "
          f"{result['cold_compile'].show(1e3, 1)} |")
    print(f"| cache hit (compile() of the same schema, its Future done) | {result['cache_hit'].show(1e3, 4)} |")
