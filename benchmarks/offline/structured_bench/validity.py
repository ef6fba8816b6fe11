"""Validity of sampled constrained output from the demo model: 50 seeded requests per
kind at temperature 1 (the test suite runs 6 per kind of these on CPU), through the
offline engine. Every request that ends by its grammar must validate."""

from __future__ import annotations

import time
from typing import Any

from engine import LLM
from tests.structured.test_engine_constraints import KINDS, is_valid, sampled


def validity(model: str, per_kind: int, max_tokens: int) -> dict[str, Any]:
    llm = LLM(model, dtype="float32", max_num_seqs=64, max_num_batched_tokens=2048, seed=0)
    start = time.perf_counter()
    by_kind = sampled(llm, KINDS, per_kind, max_tokens, chat=True)
    rows = {}
    for kind, outs in by_kind.items():
        stopped = [o for o in outs if o.finish_reason == "stop"]
        invalid = [o.text for o in stopped if not is_valid(kind, o.text)]
        rows[kind] = {"requests": len(outs), "stopped": len(stopped), "invalid": len(invalid),
                      "example_invalid": invalid[:1]}
    return {"kinds": rows, "seconds": time.perf_counter() - start, "per_kind": per_kind, "max_tokens": max_tokens}


def print_validity(report: dict[str, Any]) -> None:
    print(f"\nvalidity: {report['per_kind']} requests per kind, temperature 1, max_tokens {report['max_tokens']}, "
          f"{report['seconds']:.0f} s")
    print("| kind | requests | ended by the grammar | invalid among those |\n|---|---|---|---|")
    for kind, row in report["kinds"].items():
        print(f"| {kind} | {row['requests']} | {row['stopped']} | {row['invalid']} |")
