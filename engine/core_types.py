"""What the engine core's verbs hand back: a step's output, the engine's stats, and the
layer hook's signature (engine/engine_core.py re-exports them)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from engine.kv_cache.tiers import OffloadStats
from engine.request import Request
from engine.speculative.speculator import SpecStats

# hook(layer, computed tokens by request) inside a step's forward: EngineCore.set_layer_hook
LayerHook = Callable[[int, Mapping[str, int]], None]


@dataclass
class StepOutput:
    advanced: list[Request] = field(default_factory=list)  # got a new token this step
    finished: list[Request] = field(default_factory=list)  # finished this step (blocks freed, or once no queued step writes them)
    num_tokens: int = 0  # tokens computed this step
    num_requests: int = 0  # requests scheduled in this step (its batch)


@dataclass(frozen=True)
class EngineStats:
    """What a worker reports of its engine (its stats replies, /status)."""

    num_blocks: int
    free_blocks: int
    running: int  # requests scheduled in the last step or about to be
    waiting: int  # queued: waiting for blocks or a slot, or ready to resume
    compiling: int = 0  # of those, waiting for their grammar (bounded by grammar_compile_timeout_s)
    ranks: tuple[int, ...] = ()  # the process id of each tensor-parallel rank, rank 0 first
    preemptions: int = 0  # running requests preempted so far (their blocks freed; they recompute)
    spec: SpecStats | None = None  # speculative decoding's counters so far (a copy); None: not speculating
    offload: OffloadStats | None = None  # the KV offload tiers' figures so far; None: no tiers
    lora_adapters: tuple[str, ...] | None = None  # the LoRA adapters it holds read; None: no enable_lora
