"""LoRA adapters in the offline and P/D fuzzers (--lora FRACTION): about that fraction of
a case's requests name one of tests/lora_adapters.py's adapters, drawn from a stream
of their own (every other choice of the case stays as it was), and the engines get
fewer slots than adapters at times. The oracle runs each request alone with its adapter."""

from __future__ import annotations

import random
from pathlib import Path

from tests.fuzz.common import ENGINE_OPTIONS, LORA_ADAPTERS, OfflineCase, PDCase
from tests.lora_adapters import build_adapters


def use(model_dir: Path, root: Path) -> None:
    """Build the adapters for the fuzzed model; the oracle serves them too."""
    LORA_ADAPTERS.update(build_adapters(model_dir, root))
    ENGINE_OPTIONS.update(enable_lora=True, max_loras=len(LORA_ADAPTERS), max_lora_rank=16)


def add_loras(case: OfflineCase | PDCase, fraction: float) -> None:
    """P/D: both engines get LoRA (the prefill worker computes with the adapter the
    decode worker names), each with its own number of slots; a speculating case stays
    without adapters (the engine refuses LoRA there)."""
    if not fraction:
        return
    rng = random.Random(f"lora-{case.seed}")
    names = sorted(LORA_ADAPTERS)
    engines = [case.engine] if isinstance(case, OfflineCase) else [case.dec, case.pre]
    if any(e.get("speculative_config") for e in engines):
        return
    for engine in engines:
        engine.update(enable_lora=True, max_loras=rng.choice((1, 2, 3)), max_lora_rank=16)
    for spec in case.requests:
        if rng.random() < fraction:
            spec.lora = rng.choice(names)
